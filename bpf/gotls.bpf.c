// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * gotls.bpf.c: uprobes on Go's crypto/tls.(*Conn).Write and Read, in the Go
 * executables that captured processes run (exporter/kernel/gotls.py attaches
 * them; exporter/kernel/goelf.py reads the binary). Go >= 1.17 calls with
 * its register ABI (ABIInternal, src/cmd/compile/abi-internal.md): on amd64
 * the integer arguments in RAX, RBX, RCX, ..., the results in the same
 * registers, and R14 holds the running goroutine (g); on arm64 (Go >= 1.18)
 * the arguments and results in R0, R1, ..., R15 and g in R28. GO_ARG1,
 * GO_G below read them for the object's architecture.
 *
 * No uretprobe: Go moves a goroutine's stack when it grows, and a uretprobe's
 * rewritten return address would move with it (the runtime then crashes).
 * Each call is followed from its entry (the *Conn and the buffer, saved per
 * goroutine: a goroutine blocked in Read resumes on any thread) to each of
 * its RET instructions (user space finds them by disassembling the
 * function), where n (the first result) bytes of the buffer are the
 * plaintext moved. An entry runs twice when the stack grows (the prologue
 * calls morestack, then jumps back to the entry): it only saves, so that is
 * harmless; publishing is done once, at the RET.
 *
 * The socket is the connection's own: tls.Conn.conn is a net.Conn whose
 * concrete type must be *net.TCPConn (its itab's type hash, as the attached
 * binaries have it: go_conn_types), whose netFD's Sysfd is the fd; the fd's
 * socket is then taken as a TCP call's is (captured_fd_sock: the same
 * targets), and the chunks carry the TLS offsets of its connection, flagged
 * tls and go.
 */
#include "emit.bpf.h"
#include <bpf/bpf_tracing.h>

/* The Go register ABI's first two integer arguments (a method's receiver and
 * its first argument), its first result, and the goroutine, per object
 * architecture (bpf/Makefile's __TARGET_ARCH_). */
#if defined(__TARGET_ARCH_x86)
#define GO_ARG1(ctx) ((ctx)->ax)
#define GO_ARG2(ctx) ((ctx)->bx)
#define GO_G(ctx)    ((ctx)->r14)
#elif defined(__TARGET_ARCH_arm64)
#define GO_ARG1(ctx) (__PT_REGS_CAST(ctx)->regs[0])
#define GO_ARG2(ctx) (__PT_REGS_CAST(ctx)->regs[1])
#define GO_G(ctx)    (__PT_REGS_CAST(ctx)->regs[28])
#endif
#define GO_RET1(ctx) GO_ARG1(ctx) /* results come back in the argument registers */

struct go_call_key {
	__u64 g;     /* the goroutine (R14 on amd64, R28 on arm64) */
	__u32 tgid;  /* its process */
	__u32 probe; /* NETTAP_PROBE_GO_TLS_* */
};

struct go_call {
	__u64 conn; /* the *tls.Conn */
	__u64 buf;  /* the plaintext buffer's first byte */
};

/* Per goroutine and probe: the call between its entry and a RET. LRU: a
 * goroutine that panics out of a call leaves its entry, which ages out (or
 * the goroutine's next call replaces it). A server's idle keep-alive
 * connections each hold a goroutine inside Read: 16,384 of them at once
 * (~1.3 MB); beyond, the least recent are dropped, and counted at their
 * return (go_ret). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct go_call_key);
	__type(value, struct go_call);
} go_tls_calls SEC(".maps");

/* Where a tls.Conn's socket is: one row, written by user space before the
 * first file is attached. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_go_layout);
} go_tls_layout SEC(".maps");

/* The type hashes of *net.TCPConn in the attached binaries' itabs for
 * net.Conn (one value across Go versions so far). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u8);
} go_conn_types SEC(".maps");

static __always_inline int go_enter(struct pt_regs *ctx, __u32 probe)
{
	struct nettap_capture_config *cfg = active_config();
	struct go_call_key key = { .g = GO_G(ctx),
				   .tgid = bpf_get_current_pid_tgid() >> 32,
				   .probe = probe };
	struct go_call call = { .conn = GO_ARG1(ctx), .buf = GO_ARG2(ctx) };

	if (!cfg)
		return 0;
	/* Only task targets: a task they do not name is never captured. */
	if (!(cfg->flags & (NETTAP_TARGET_PORT | NETTAP_TARGET_NETNS)) && !task_matches(cfg))
		return 0;
	if (bpf_map_update_elem(&go_tls_calls, &key, &call, BPF_ANY))
		count_insert_failure(NETTAP_MAP_GO_TLS_CALLS);
	return 0;
}

/* The fd of a *tls.Conn's TCP connection, or -1 when its net.Conn is not a
 * *net.TCPConn (a net.Pipe, a user's wrapper: nothing of theirs is read as
 * an fd). Every load is of user memory, checked. */
static __always_inline long go_conn_fd(__u64 conn)
{
	struct nettap_go_layout *l;
	__u32 zero = 0, hash = 0;
	struct {
		__u64 tab;
		__u64 data;
	} iface = {};
	__u64 nfd = 0;
	long fd = -1;

	l = bpf_map_lookup_elem(&go_tls_layout, &zero);
	if (!l || !l->itab_hash)
		return -1;
	if (bpf_probe_read_user(&iface, sizeof(iface), (void *)(conn + l->conn)) || !iface.tab)
		return -1;
	if (bpf_probe_read_user(&hash, sizeof(hash), (void *)(iface.tab + l->itab_hash)))
		return -1;
	if (!bpf_map_lookup_elem(&go_conn_types, &hash))
		return -1;
	if (bpf_probe_read_user(&nfd, sizeof(nfd), (void *)(iface.data + l->fd)) || !nfd)
		return -1;
	if (bpf_probe_read_user(&fd, sizeof(fd), (void *)(nfd + l->sysfd)))
		return -1;
	return fd;
}

static __always_inline int go_ret(struct pt_regs *ctx, __u32 probe, const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct go_call_key key = { .g = GO_G(ctx), .tgid = id >> 32, .probe = probe };
	struct nettap_capture_config *cfg;
	long n = GO_RET1(ctx), fd;
	struct go_call *f;
	struct go_call call;
	struct sock *sk;
	__u64 skp;

	f = bpf_map_lookup_elem(&go_tls_calls, &key);
	if (!f) {
		/* A target's call not followed: its entry dropped by the LRU, or
		 * made before the file was attached or the process named: counted
		 * (map_insert_failures; where a task target can tell). */
		cfg = active_config();
		if (cfg && task_matches(cfg))
			count_insert_failure(NETTAP_MAP_GO_TLS_CALLS);
		return 0;
	}
	call = *f;
	bpf_map_delete_elem(&go_tls_calls, &key);
	cfg = active_config();
	if (!cfg)
		return 0;
	fd = go_conn_fd(call.conn);
	if (fd < 0 || fd > 0x7fffffff)
		return 0;
	sk = captured_fd_sock(cfg, fd, fast);
	if (!sk)
		return 0;
	skp = (__u64)sk;
	/* n may be > 0 with an error (a Write cut short): those bytes moved. */
	tls_publish(cfg, probe, skp, bpf_map_lookup_elem(&capture_conns, &skp), call.buf,
		    n > 0 ? n : 0, NETTAP_CHUNK_F_TLS | NETTAP_CHUNK_F_GO, fast);
	return 0;
}

#define NETTAP_GO_TLS(name, probe, sym)                                                     \
	NETTAP_PROG("probe=" #name " mech=uprobe lib=go attach=" sym)                       \
	SEC("uprobe")                                                                       \
	int name##_enter(struct pt_regs *ctx)                                               \
	{                                                                                   \
		return go_enter(ctx, probe);                                                \
	}                                                                                   \
	NETTAP_PROG("probe=" #name " mech=uprobe lib=go variant=fast attach=" sym "@ret")   \
	SEC("uprobe")                                                                       \
	int name##_ret(struct pt_regs *ctx)                                                 \
	{                                                                                   \
		return go_ret(ctx, probe, FAST);                                            \
	}                                                                                   \
	NETTAP_PROG("probe=" #name " mech=uprobe lib=go variant=compat attach=" sym "@ret") \
	SEC("uprobe")                                                                       \
	int name##_ret_compat(struct pt_regs *ctx)                                          \
	{                                                                                   \
		return go_ret(ctx, probe, COMPAT);                                          \
	}

NETTAP_GO_TLS(go_tls_write, NETTAP_PROBE_GO_TLS_WRITE, "crypto/tls.(*Conn).Write")
NETTAP_GO_TLS(go_tls_read, NETTAP_PROBE_GO_TLS_READ, "crypto/tls.(*Conn).Read")

/* ring dlopen: a process ran a program (execve), while a task target names
 * it or a netns or port target is in force (whose processes the kernel
 * cannot tell at exec: user space decides, exporter/kernel/tlsfiles.py):
 * user space looks at its executable for Go's crypto/tls, so a Go program
 * started in a captured cgroup is attached before it has set up a
 * connection. */
NETTAP_PROG("probe=go_tls_write,go_tls_read mech=tracepoint")
SEC("tracepoint/sched/sched_process_exec")
int tls_exec(void *ctx)
{
	struct nettap_capture_config *cfg = active_config();
	struct task_struct *task;
	struct file *file;

	if (!cfg)
		return 0;
	if (!(cfg->flags & (NETTAP_TARGET_PORT | NETTAP_TARGET_NETNS)) && !task_matches(cfg))
		return 0;
	task = (struct task_struct *)bpf_get_current_task();
	file = BPF_CORE_READ(task, mm, exe_file);
	if (file)
		dlopen_submit(file);
	return 0;
}
