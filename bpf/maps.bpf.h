/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * maps.bpf.h: every map of tcp.bpf.o, and the per-call state they hold.
 * User space finds them by these names (exporter/kernel/loader.py, collectors).
 */
#ifndef NETTAP_MAPS_BPF_H
#define NETTAP_MAPS_BPF_H

#include "vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include "tcp.h"
#include "shared.bpf.h"

/* ---- capture targets (user space rewrites them at run time) ------------ */

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_capture_config);
} capture_config SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC); /* memory grows with use */
	__uint(max_entries, 1024);
	__type(key, __u32);   /* tgid */
	__type(value, __u32); /* NETTAP_MATCH_CAPTURE | the kinds it asks (tcp.h) */
} capture_pids SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, __u64); /* cgroup v2 id */
	__type(value, __u32);
} capture_cgroups SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, __u32); /* network namespace inode */
	__type(value, __u32);
} capture_netns SEC(".maps");

/* A 65536-bit prefilter of capture_pids: bit (tgid & 63) of word
 * ((tgid >> 6) & 1023) is set for every pid target. An array read that the
 * verifier inlines says no for almost every other process before the hash
 * lookup (a tgid that shares a target's bit pays that lookup too). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} capture_pid_bits SEC(".maps");

/* Per CPU and ring: bytes published since this CPU last looked at the
 * ring's fill (wakeup_flags). Read and written without atomics: a lost
 * add only moves the next look. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_RING_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} ring_unchecked SEC(".maps");

/* A 65536-bit port bitmap: bit (port & 63) of word (port >> 6), the
 * captured ports (what every call's filter reads). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} capture_ports SEC(".maps");

/* A port target's entry, as capture_pids': what it asks. Read once a
 * connection, where its capture is decided (filter.bpf.h: target_kinds). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1024);
	__type(key, __u32); /* port */
	__type(value, __u32);
} capture_port_kinds SEC(".maps");

/* ---- counters ---------------------------------------------------------- */

/* Per-CPU rows, still added to atomically: on PREEMPT_RT a BPF program runs
 * with migration disabled but preemptible, so another task's program can
 * run on the same CPU between a load and its store. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_PROBE_COUNT);
	__type(key, __u32);
	__type(value, struct nettap_probe_counters);
} probe_counters SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_RING_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} ringbuf_drops SEC(".maps");

/* Per CPU and map (NETTAP_MAP_*): inserts the kernel refused. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_MAP_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} map_insert_failures SEC(".maps");

/* Captured sockets' state changes, resets and errors (struct nettap_obs_counters). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_obs_counters);
} obs_counters SEC(".maps");

/* ---- rings (sizes are defaults; user space sets the configured ones) ---- */

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} capture_chunks SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 << 10);
} capture_eof SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 10);
} logs SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} obs_events SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 10);
} dlopen SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 << 10);
} segments SEC(".maps");

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 128 << 10);
} dns SEC(".maps");

/* ---- one call, from its entry to its return ----------------------------- */

/* How far one call's chunking got. */
struct emit_state {
	__u64 seg_base; /* address of the current segment */
	__u64 seg_left; /* bytes left in it */
	__u64 iov;	/* next struct iovec, when vectored */
	__u64 iov_left;
	__u64 skip; /* bytes of the first segment already consumed */
	__u64 done; /* bytes of the call captured so far */
	__u64 want; /* bytes of the call to capture */
	__u64 published;
	__u64 dropped;
	__u64 submit_flags; /* wakeup decision, taken once per call */
	__u32 probe;
	__u32 read_failed; /* bpf_probe_read_user errors this call */
};

/*
 * A call between its entry and its return, and the scratch its return
 * chunks with. It is per task, never per CPU: a per-CPU scratch is shared by
 * every task a CPU runs, and on PREEMPT_RT a program can be preempted by
 * another task's program on the same CPU. Keeping the chunking state in map
 * memory (not the stack) also lets the verifier converge on the chunk loop:
 * it does not track values in map memory, so the loop body's states do not
 * differ per byte count.
 */
struct inflight {
	__u64 sk;     /* kernel address of the sock */
	__u64 buf;    /* user buffer, or an iovec array */
	__u32 iovcnt; /* 0: buf is a plain buffer */
	__u32 probe;
	__u32 valid;
	__u8 iov_kernel;  /* the iovec array is kernel memory (probe of a
			   * kernel function) rather than user memory */
	__u8 unreadable;  /* the iterator holds no user buffer */
	__u16 iter_type;  /* the kernel's number for it, for the log */
	__u64 skip;	  /* iterator offset into the first segment */
	__u64 task_start; /* compat: the thread's start_time, so a thread that
			   * reuses a dead thread's id never takes its entry */
	struct emit_state st;
	struct nettap_chunk hdr; /* header copied into every chunk; data unused */
};

/* Linux 5.11+: task-local storage (no hashing; gone with the task, also
 * when a thread dies inside the syscall). Used by the "fast" programs. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inflight);
} inflight_calls NETTAP_MAP("variant=fast") SEC(".maps");

/* Linux 5.8+: the same state keyed by pid_tgid, for the "compat" programs:
 * kept between a thread's calls where the hash allocates at run time (6.1),
 * else removed at the call's return (inflight_end); removed when the thread
 * ends (inflight_exit, lifecycle.bpf.c). One whose removal was missed is told
 * apart by its thread's start time when the id is reused (inflight_find).
 * Where it must be preallocated (before 6.1: features.py's bpf_mem_alloc), it
 * is paid in full: 4096 threads inside a captured call at once, x ~650 B. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct inflight);
} inflight_compat NETTAP_MAP("variant=compat prealloc_max=4096") SEC(".maps");

/*
 * Calls in flight, counted per slot of the thread id (inflight_slot): set at
 * an entry the filter kept, cleared at its return. The return programs run
 * at every write/sendto/read exit on the node; a zero slot tells them, with
 * one load and no lookup, that their task has no call to finish. A thread
 * killed inside a captured call leaves its slot counted (the fast variant's
 * task storage dies without a return): the threads sharing that slot only
 * pay the lookup again, nothing is lost or mistaken. A plain global, not a
 * map lookup: programs index it directly (its own section, so user space
 * and the tests find it as one array map).
 */
#define NETTAP_INFLIGHT_SLOTS 1024
NETTAP_SHARED __u32 inflight_slots[NETTAP_INFLIGHT_SLOTS] SEC(".bss.inflight");

/* Slot of a thread: the tid's low 10 bits, permuted so that neighbouring
 * tids (a server's and its client's, threads started together) sit on
 * different cache lines. With tid & mask they shared one (16 slots a line),
 * and every captured call's locked add bounced it between their CPUs: the
 * hottest instruction of the captured entry. */
static __always_inline __u32 thread_slot(__u64 pid_tgid)
{
	__u32 tid = (__u32)pid_tgid, line = (tid & 63) << 4, slot = (tid >> 6) & 15;

	/* An add, then the mask: Linux 5.10's verifier loses the bounds of an
	 * or ("unbounded min value"), and clang writes an add of disjoint bits
	 * as one unless it cannot see the bits. */
	barrier_var(slot);
	return (line + slot) & (NETTAP_INFLIGHT_SLOTS - 1);
}

static __always_inline __u32 *inflight_slot(__u64 pid_tgid)
{
	return &inflight_slots[thread_slot(pid_tgid)];
}

/* A zeroed struct inflight to insert from: too big for the BPF stack. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inflight);
} inflight_zero NETTAP_MAP("variant=compat") SEC(".maps");

#endif /* NETTAP_MAPS_BPF_H */
