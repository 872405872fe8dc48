// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tcp.bpf.c: nettap's TCP send/receive and lifecycle probes.
 *
 * Two probes, tcp_sendmsg and tcp_recvmsg, each in up to three attach
 * mechanisms. User space (exporter/loader.py) decides per probe, before
 * load, which mechanism the kernel accepts and switches the others' autoload
 * off: fentry/fexit, then kprobe/kretprobe, then syscall tracepoints. The
 * tracepoint path is the complete one (it sees the user buffer, so it
 * captures payload); the fentry and kprobe paths count calls, returns and
 * bytes on the kernel functions themselves and publish no payload.
 *
 * The filter runs first and leaves early: a call that matches no capture
 * target touches no counter. Targets live in maps that user space rewrites
 * at run time (capture_config, capture_pids, capture_cgroups,
 * capture_netns, capture_ports).
 */
#include "vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_endian.h>
#include "tcp.h"

#define AF_INET		2
#define AF_INET6	10
#define IPPROTO_TCP	6
#define SOCK_STREAM	1
#define S_IFMT		00170000
#define S_IFSOCK	0140000
#define TCP_CLOSE	7

/*
 * Reading kernel memory: every bpf_probe_read_kernel() costs a helper call
 * (about 90 ns on nettap's CI machine, where an empty program costs 75 ns),
 * and the filter runs on every read/write of the node. So the programs walk
 * kernel structs with direct loads instead: bpf_get_current_task_btf()
 * gives a BTF pointer to the task, and bpf_rdonly_cast() (Linux 6.2, commit
 * fd264ca02094 "bpf: Add a kfunc to type cast from bpf uapi ctx to kernel
 * ctx") turns a plain address into one. The verifier turns such loads into
 * exception-handled loads (PROBE_MEM): a bad address reads 0, never faults.
 */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;
#define KCAST(type, ptr) ((type *)bpf_rdonly_cast((void *)(ptr), bpf_core_type_id_kernel(type)))

/* ---- maps ------------------------------------------------------------ */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_capture_config);
} capture_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);	/* memory grows with use */
	__uint(max_entries, 1024);
	__type(key, __u32);		/* tgid */
	__type(value, __u8);
} capture_pids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);	/* memory grows with use */
	__uint(max_entries, 1024);
	__type(key, __u64);		/* cgroup v2 id */
	__type(value, __u8);
} capture_cgroups SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);	/* memory grows with use */
	__uint(max_entries, 1024);
	__type(key, __u32);		/* network namespace inode */
	__type(value, __u8);
} capture_netns SEC(".maps");

/* 65536-bit port bitmap: bit (port & 63) of word (port >> 6). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} capture_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_PROBE_COUNT);
	__type(key, __u32);
	__type(value, struct nettap_probe_counters);
} probe_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NETTAP_RING_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} ringbuf_drops SEC(".maps");

/* Sizes here are defaults; user space sets the configured ones before load. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} capture_chunks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 << 10);
} capture_eof SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 10);
} logs SEC(".maps");

/* A call between its entry and its return, in task-local storage: no
 * hashing, nothing to delete (valid is cleared at the return), and it goes
 * away with the task, also when a thread dies inside the syscall. */
struct inflight {
	__u64 sk;		/* kernel address of the sock */
	__u64 buf;		/* user buffer, or user iovec array */
	__u32 iovcnt;		/* 0: buf is a plain buffer */
	__u32 probe;
	__u32 valid;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inflight);
} inflight_calls SEC(".maps");

/* Captured connections, keyed by socket address; removed at TCP_CLOSE. */
struct conn {
	__u64 id;
	__u64 start_ns;
	__u64 tx_off;		/* also the bytes sent */
	__u64 rx_off;		/* also the bytes received */
	__u64 tx_calls;
	__u64 rx_calls;
	__u32 pid;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);	/* memory grows with use */
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct conn);
} capture_conns SEC(".maps");

/* Entries in capture_conns, so user space need not walk the map to know. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} capture_conns_live SEC(".maps");

static __always_inline void conns_live_add(__s64 d)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&capture_conns_live, &zero);

	if (n)
		__sync_fetch_and_add(n, d);
}

/* Typed globals put the record layouts into the object's BTF, where
 * tests/unit/test_layout.py compares them with exporter/records.py. */
struct nettap_chunk btf_nettap_chunk __attribute__((unused));
struct nettap_eof btf_nettap_eof __attribute__((unused));
struct nettap_log btf_nettap_log __attribute__((unused));

__u64 next_conn_id = 1;

/* ---- helpers ----------------------------------------------------------- */

static __always_inline void count_drop(__u32 ring, __u64 n)
{
	__u64 *d = bpf_map_lookup_elem(&ringbuf_drops, &ring);

	if (d)
		*d += n;	/* per-CPU row: no other writer */
}

static __always_inline __u64 wakeup_flags(void *ring,
					   struct nettap_capture_config *cfg)
{
	/* No wakeup per record: the reader polls on a short timer, and is
	 * woken only once enough is pending that waiting could overflow. */
	if (cfg && bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA) >= cfg->wakeup_bytes)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

static __always_inline void emit_log(__u32 code, __u32 probe, __u64 a0, __u64 a1)
{
	struct nettap_log *l = bpf_ringbuf_reserve(&logs, sizeof(*l), 0);
	__u64 id = bpf_get_current_pid_tgid();

	if (!l) {
		count_drop(NETTAP_RING_LOGS, 1);
		return;
	}
	l->ts_ns = bpf_ktime_get_ns();
	l->code = code;
	l->probe = probe;
	l->arg0 = a0;
	l->arg1 = a1;
	l->pid = id >> 32;
	l->tid = (__u32)id;
	bpf_get_current_comm(l->comm, sizeof(l->comm));
	bpf_ringbuf_submit(l, 0);
}

static __always_inline struct nettap_probe_counters *counters(__u32 probe)
{
	return bpf_map_lookup_elem(&probe_counters, &probe);
}

/* Index of a single set bit: debruijn32[(bit * 0x077CB531) >> 27]. */
const __u8 debruijn32[32] = {
	0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8,
	31, 27, 13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9,
};

/* The task-level targets (pid, cgroup): does the current task match? */
static __always_inline bool task_matches(struct nettap_capture_config *cfg)
{
	if (cfg->flags & NETTAP_TARGET_PID) {
		__u32 tgid = bpf_get_current_pid_tgid() >> 32;

		if (bpf_map_lookup_elem(&capture_pids, &tgid))
			return true;
	}
	if (cfg->flags & NETTAP_TARGET_CGROUP) {
		__u32 levels = cfg->cgroup_levels;

		/* Containers nest: match the target's level of the current
		 * task's ancestry, one lookup per level a target sits at (user
		 * space allows at most NETTAP_MAX_CGROUP_LEVELS of them). Each
		 * step takes the lowest set bit and finds its index by a de
		 * Bruijn multiply, so the verifier walks 4 steps, not 32. */
		for (int i = 0; i < NETTAP_MAX_CGROUP_LEVELS && levels; i++) {
			__u32 low = levels & -levels;
			__u32 lvl = debruijn32[((low * 0x077CB531U) >> 27) & 31];
			__u64 cg = bpf_get_current_ancestor_cgroup_id(lvl);

			levels &= levels - 1;
			if (cg && bpf_map_lookup_elem(&capture_cgroups, &cg))
				return true;
		}
	}
	return false;
}

/* The socket-level targets (netns, port): does this socket match?
 * sk is a BTF pointer (KCAST or a typed argument). */
static __always_inline bool sock_matches(struct nettap_capture_config *cfg,
					 struct sock *sk)
{
	if (cfg->flags & NETTAP_TARGET_NETNS) {
		__u32 inum = sk->__sk_common.skc_net.net->ns.inum;

		if (bpf_map_lookup_elem(&capture_netns, &inum))
			return true;
	}
	if (cfg->flags & NETTAP_TARGET_PORT) {
		__u16 ports[2];

		ports[0] = sk->__sk_common.skc_num;
		ports[1] = bpf_ntohs(sk->__sk_common.skc_dport);
		for (int i = 0; i < 2; i++) {
			__u32 word = ports[i] >> 6;
			__u64 *bits = bpf_map_lookup_elem(&capture_ports, &word);

			if (bits && (*bits & (1ULL << (ports[i] & 63))))
				return true;
		}
	}
	return false;
}

/* fd of the current task -> its TCP sock (a BTF pointer), or NULL. One
 * helper call: the fd array is indexed by a variable, which direct loads
 * cannot do. */
static __always_inline struct sock *fd_to_tcp_sock(unsigned long fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct fdtable *fdt = task->files->fdt;
	struct file **fds;
	struct file *file = NULL;
	struct socket *sock;
	struct sock *sk;

	if (!fdt || fd >= fdt->max_fds)
		return NULL;
	fds = fdt->fd;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]) || !file)
		return NULL;
	file = KCAST(struct file, file);
	if ((file->f_inode->i_mode & S_IFMT) != S_IFSOCK)
		return NULL;
	sock = KCAST(struct socket, file->private_data);
	sk = sock->sk;
	if (!sk || sk->sk_type != SOCK_STREAM || sk->sk_protocol != IPPROTO_TCP)
		return NULL;
	return sk;
}

static __always_inline struct nettap_capture_config *active_config(void)
{
	__u32 zero = 0;
	struct nettap_capture_config *cfg = bpf_map_lookup_elem(&capture_config, &zero);

	if (!cfg || !cfg->flags)
		return NULL;
	return cfg;
}

/* ---- tracepoint mechanism: entry --------------------------------------- */

/* Count an entry on a captured TCP socket and remember the call until it
 * returns. buf is a user buffer, or a user iovec array when iovcnt > 0. */
static __always_inline int enter_sock(__u32 probe, struct sock *sk,
				      __u64 buf, __u32 iovcnt)
{
	struct nettap_probe_counters *c = counters(probe);
	struct inflight *in;

	if (c)
		c->calls++;
	in = bpf_task_storage_get(&inflight_calls, bpf_get_current_task_btf(), 0,
				  BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!in) {
		emit_log(NETTAP_LOG_INFLIGHT_FULL, probe, 0, 0);
		return 0;
	}
	in->sk = (__u64)sk;
	in->buf = buf;
	in->iovcnt = iovcnt;
	in->probe = probe;
	in->valid = 1;
	return 0;
}

/* Syscall entry: the filter, cheapest test first. */
static __always_inline int enter_call(__u32 probe, unsigned long fd,
				      __u64 buf, __u32 iovcnt)
{
	struct nettap_capture_config *cfg = active_config();
	bool task_ok;
	struct sock *sk;

	if (!cfg)
		return 0;
	task_ok = task_matches(cfg);
	if (!task_ok && !(cfg->flags & (NETTAP_TARGET_NETNS | NETTAP_TARGET_PORT)))
		return 0;
	sk = fd_to_tcp_sock(fd);
	if (!sk)
		return 0;
	if (!task_ok && !sock_matches(cfg, sk))
		return 0;
	return enter_sock(probe, sk, buf, iovcnt);
}

/* write(2), sendto(2): args fd, buf, len */
SEC("tracepoint/syscalls/sys_enter_write")
int tcp_sendmsg_enter(struct trace_event_raw_sys_enter *ctx)
{
	return enter_call(NETTAP_PROBE_TCP_SENDMSG, ctx->args[0], ctx->args[1], 0);
}

/* writev(2): args fd, iov, iovcnt */
SEC("tracepoint/syscalls/sys_enter_writev")
int tcp_sendmsg_enter_iov(struct trace_event_raw_sys_enter *ctx)
{
	__u32 n = ctx->args[2];

	return enter_call(NETTAP_PROBE_TCP_SENDMSG, ctx->args[0], ctx->args[1], n ? n : 1);
}

static __always_inline int enter_msg(__u32 probe, struct trace_event_raw_sys_enter *ctx)
{
	struct user_msghdr *umsg = (void *)ctx->args[1];
	struct iovec *iov = NULL;
	__u64 n = 0;

	bpf_probe_read_user(&iov, sizeof(iov), &umsg->msg_iov);
	bpf_probe_read_user(&n, sizeof(n), &umsg->msg_iovlen);
	return enter_call(probe, ctx->args[0], (__u64)iov, n ? (__u32)n : 1);
}

/* sendmsg(2): args fd, msghdr, flags */
SEC("tracepoint/syscalls/sys_enter_sendmsg")
int tcp_sendmsg_enter_msg(struct trace_event_raw_sys_enter *ctx)
{
	return enter_msg(NETTAP_PROBE_TCP_SENDMSG, ctx);
}

/* read(2), recvfrom(2): args fd, buf, len */
SEC("tracepoint/syscalls/sys_enter_read")
int tcp_recvmsg_enter(struct trace_event_raw_sys_enter *ctx)
{
	return enter_call(NETTAP_PROBE_TCP_RECVMSG, ctx->args[0], ctx->args[1], 0);
}

/* readv(2): args fd, iov, iovcnt */
SEC("tracepoint/syscalls/sys_enter_readv")
int tcp_recvmsg_enter_iov(struct trace_event_raw_sys_enter *ctx)
{
	__u32 n = ctx->args[2];

	return enter_call(NETTAP_PROBE_TCP_RECVMSG, ctx->args[0], ctx->args[1], n ? n : 1);
}

/* recvmsg(2): args fd, msghdr, flags */
SEC("tracepoint/syscalls/sys_enter_recvmsg")
int tcp_recvmsg_enter_msg(struct trace_event_raw_sys_enter *ctx)
{
	return enter_msg(NETTAP_PROBE_TCP_RECVMSG, ctx);
}

/* ---- tracepoint mechanism: return -------------------------------------- */

/* The state of one call's chunking. It lives in a per-CPU map, not on the
 * stack: the verifier does not track values in map memory, so the states
 * of the bpf_loop callback below converge after one pass instead of being
 * explored once per distinct byte count. */
struct emit_state {
	__u64 seg_base;		/* user address of the current segment */
	__u64 seg_left;		/* bytes left in it */
	__u64 iov;		/* next user iovec, when vectored */
	__u64 iov_left;
	__u64 done;		/* bytes of the call captured so far */
	__u64 want;		/* bytes of the call to capture */
	__u64 published;
	__u64 dropped;
	__u64 submit_flags;	/* wakeup decision, taken once per call */
	__u32 probe;
	__u32 pad;
};

struct call_scratch {
	struct nettap_chunk hdr;	/* header copied into every chunk */
	struct emit_state st;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct call_scratch);
} call_scratch SEC(".maps");

/* Addresses and ports of a socket, as both record kinds carry them. */
static __always_inline void read_addrs(struct sock *sk, __u16 *family, __u16 *sport,
				       __u16 *dport, __u8 *saddr, __u8 *daddr)
{
	struct sock_common *c = &sk->__sk_common;

	*family = c->skc_family;
	*sport = c->skc_num;
	*dport = bpf_ntohs(c->skc_dport);
	__builtin_memset(saddr, 0, 16);
	__builtin_memset(daddr, 0, 16);
	if (*family == AF_INET6) {
		__builtin_memcpy(saddr, &c->skc_v6_rcv_saddr, 16);
		__builtin_memcpy(daddr, &c->skc_v6_daddr, 16);
	} else {
		*(__u32 *)saddr = c->skc_rcv_saddr;
		*(__u32 *)daddr = c->skc_daddr;
	}
}

/* bpf_loop callback: publish one chunk of up to NETTAP_CHUNK_DATA bytes,
 * or step to the next iovec. Returns 1 to stop. bpf_loop (Linux 5.17) has
 * the verifier check this body once; an open-coded loop of the same bound
 * explodes past the 1M-instruction limit. */
static long emit_chunk(__u32 i, void *arg)
{
	struct call_scratch *cs;
	struct emit_state *st;
	struct nettap_chunk *hdr, *rec;
	__u32 zero = 0;
	__u64 n;
	long err;

	cs = bpf_map_lookup_elem(&call_scratch, &zero);
	if (!cs)
		return 1;
	st = &cs->st;
	hdr = &cs->hdr;
	if (st->done >= st->want)
		return 1;
	if (st->seg_left == 0) {
		struct iovec v = {};

		if (st->iov_left == 0)
			return 1;
		if (bpf_probe_read_user(&v, sizeof(v), (void *)st->iov))
			return 1;
		st->iov += sizeof(v);
		st->iov_left--;
		st->seg_base = (__u64)v.iov_base;
		st->seg_left = v.iov_len;
		return 0;
	}
	n = st->want - st->done;
	if (n > st->seg_left)
		n = st->seg_left;
	/* Clamp last, on the register passed to the helper, so the verifier
	 * sees n <= NETTAP_CHUNK_DATA whatever clang reorders. */
	barrier_var(n);
	if (n > NETTAP_CHUNK_DATA)
		n = NETTAP_CHUNK_DATA;

	rec = bpf_ringbuf_reserve(&capture_chunks, sizeof(*rec), 0);
	if (!rec) {
		st->dropped++;
	} else {
		__builtin_memcpy(rec, hdr, offsetof(struct nettap_chunk, data));
		rec->offset = hdr->call_offset + st->done;
		rec->len = n;
		err = bpf_probe_read_user(rec->data, n, (void *)st->seg_base);
		if (err) {
			__builtin_memset(rec->data, 0, sizeof(rec->data));
			rec->flags |= NETTAP_CHUNK_F_READ_FAILED;
			emit_log(NETTAP_LOG_READ_USER_FAILED, st->probe, (__u64)-err, n);
		}
		bpf_ringbuf_submit(rec, st->submit_flags);
		st->published++;
	}
	st->seg_base += n;
	st->seg_left -= n;
	st->done += n;
	return 0;
}

static __always_inline int exit_call(__u32 probe, long ret)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct inflight *in = bpf_task_storage_get(&inflight_calls, bpf_get_current_task_btf(), 0, 0);
	struct nettap_capture_config *cfg;
	struct nettap_probe_counters *c;
	struct call_scratch *cs;
	struct nettap_chunk *hdr;
	struct emit_state *st;
	struct conn *cn, fresh = {};
	struct sock *sk;
	__u64 key, off = 0, buf;
	__u32 iovcnt, zero = 0;

	if (!in || !in->valid || in->probe != probe)
		return 0;
	in->valid = 0;
	sk = (struct sock *)in->sk;
	buf = in->buf;
	iovcnt = in->iovcnt;

	c = counters(probe);
	if (!c)
		return 0;
	c->returns++;
	if (ret <= 0)
		return 0;
	c->bytes += ret;

	cs = bpf_map_lookup_elem(&call_scratch, &zero);
	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	if (!cs || !cfg)
		return 0;
	hdr = &cs->hdr;
	st = &cs->st;

	key = (__u64)sk;
	cn = bpf_map_lookup_elem(&capture_conns, &key);
	if (!cn) {
		fresh.id = __sync_fetch_and_add(&next_conn_id, 1);
		fresh.start_ns = bpf_ktime_get_ns();
		fresh.pid = id >> 32;
		/* BPF_NOEXIST: a racing thread may have inserted it first. */
		long err = bpf_map_update_elem(&capture_conns, &key, &fresh, BPF_NOEXIST);

		if (!err)
			conns_live_add(1);
		cn = bpf_map_lookup_elem(&capture_conns, &key);
		if (!cn && err)
			emit_log(NETTAP_LOG_CONN_TABLE_FULL, probe, -err, 0);
	}

	hdr->flags = 0;
	if (cn) {
		/* Two threads moving bytes on one socket at once each get a
		 * distinct range of the stream. */
		if (probe == NETTAP_PROBE_TCP_SENDMSG) {
			off = __sync_fetch_and_add(&cn->tx_off, ret);
			__sync_fetch_and_add(&cn->tx_calls, 1);
		} else {
			off = __sync_fetch_and_add(&cn->rx_off, ret);
			__sync_fetch_and_add(&cn->rx_calls, 1);
		}
		hdr->conn_id = cn->id;
	} else {
		hdr->conn_id = 0;
		hdr->flags = NETTAP_CHUNK_F_NO_CONN;
	}

	hdr->ts_ns = bpf_ktime_get_ns();
	hdr->call_offset = off;
	hdr->call_len = ret;
	hdr->pid = id >> 32;
	hdr->tid = (__u32)id;
	hdr->direction = probe == NETTAP_PROBE_TCP_SENDMSG ? NETTAP_DIR_EGRESS : NETTAP_DIR_INGRESS;
	read_addrs(KCAST(struct sock, sk), &hdr->family, &hdr->sport, &hdr->dport,
		   hdr->saddr, hdr->daddr);
	bpf_get_current_comm(hdr->comm, sizeof(hdr->comm));

	__builtin_memset(st, 0, sizeof(*st));
	st->probe = probe;
	/* One ring query per call, not per chunk: a call's chunks land
	 * together, and the reader only needs waking once the ring fills. */
	st->submit_flags = wakeup_flags(&capture_chunks, cfg);
	st->want = ret;
	if (st->want > cfg->max_payload_bytes)
		st->want = cfg->max_payload_bytes;
	if (iovcnt == 0) {
		st->seg_base = buf;
		st->seg_left = ret;
	} else {
		st->iov = buf;
		st->iov_left = iovcnt > NETTAP_MAX_IOV ? NETTAP_MAX_IOV : iovcnt;
	}

	bpf_loop(NETTAP_MAX_CHUNKS_PER_CALL + NETTAP_MAX_IOV, emit_chunk, NULL, 0);
	if (iovcnt > NETTAP_MAX_IOV && st->done < st->want)
		emit_log(NETTAP_LOG_IOV_TRUNCATED, probe, iovcnt, st->want - st->done);

	c->chunks += st->published;
	if (st->dropped)
		count_drop(NETTAP_RING_CAPTURE_CHUNKS, st->dropped);
	return 0;
}

/* Attached by user space to sys_exit_write and sys_exit_sendto, writev,
 * sendmsg (one program, several tracepoints). */
SEC("tracepoint/syscalls/sys_exit_write")
int tcp_sendmsg_exit(struct trace_event_raw_sys_exit *ctx)
{
	return exit_call(NETTAP_PROBE_TCP_SENDMSG, ctx->ret);
}

SEC("tracepoint/syscalls/sys_exit_read")
int tcp_recvmsg_exit(struct trace_event_raw_sys_exit *ctx)
{
	return exit_call(NETTAP_PROBE_TCP_RECVMSG, ctx->ret);
}

/* ---- fentry/fexit and kprobe/kretprobe mechanisms ---------------------- */

/* Kernel-function entry: the socket is an argument, no fd walk. The user
 * buffer is known when the msghdr's iterator is a single user buffer
 * (ITER_UBUF, what send/recv/read/write build since Linux 6.0, commit
 * fcb14cb1bdac "new iov_iter flavour - ITER_UBUF"); other iterators are
 * counted and publish chunks flagged READ_FAILED with no payload. */
static __always_inline int enter_func(__u32 probe, struct sock *sk, struct msghdr *msg)
{
	struct nettap_capture_config *cfg = active_config();
	__u64 buf = 0;

	if (!cfg || !sk)
		return 0;
	sk = KCAST(struct sock, sk);
	if (sk->sk_protocol != IPPROTO_TCP)
		return 0;
	if (!task_matches(cfg) && !sock_matches(cfg, sk))
		return 0;
	if (bpf_core_enum_value_exists(enum iter_type, ITER_UBUF) &&
	    BPF_CORE_READ(msg, msg_iter.iter_type) ==
	    bpf_core_enum_value(enum iter_type, ITER_UBUF))
		buf = (__u64)BPF_CORE_READ(msg, msg_iter.ubuf);
	return enter_sock(probe, sk, buf, 0);
}

SEC("fentry/tcp_sendmsg")
int BPF_PROG(tcp_sendmsg_fentry, struct sock *sk, struct msghdr *msg)
{
	return enter_func(NETTAP_PROBE_TCP_SENDMSG, sk, msg);
}

SEC("fexit/tcp_sendmsg")
int tcp_sendmsg_fexit(void *ctx)
{
	__u64 ret = 0;

	bpf_get_func_ret(ctx, &ret);
	return exit_call(NETTAP_PROBE_TCP_SENDMSG, (int)ret);
}

SEC("fentry/tcp_recvmsg")
int BPF_PROG(tcp_recvmsg_fentry, struct sock *sk, struct msghdr *msg)
{
	return enter_func(NETTAP_PROBE_TCP_RECVMSG, sk, msg);
}

SEC("fexit/tcp_recvmsg")
int tcp_recvmsg_fexit(void *ctx)
{
	__u64 ret = 0;

	/* The return's argument slot moved when tcp_recvmsg lost its
	 * nonblock argument (Linux 5.19); bpf_get_func_ret finds it. */
	bpf_get_func_ret(ctx, &ret);
	return exit_call(NETTAP_PROBE_TCP_RECVMSG, (int)ret);
}

SEC("kprobe/tcp_sendmsg")
int BPF_KPROBE(tcp_sendmsg_kprobe, struct sock *sk, struct msghdr *msg)
{
	return enter_func(NETTAP_PROBE_TCP_SENDMSG, sk, msg);
}

SEC("kretprobe/tcp_sendmsg")
int BPF_KRETPROBE(tcp_sendmsg_kretprobe, int ret)
{
	return exit_call(NETTAP_PROBE_TCP_SENDMSG, ret);
}

SEC("kprobe/tcp_recvmsg")
int BPF_KPROBE(tcp_recvmsg_kprobe, struct sock *sk, struct msghdr *msg)
{
	return enter_func(NETTAP_PROBE_TCP_RECVMSG, sk, msg);
}

SEC("kretprobe/tcp_recvmsg")
int BPF_KRETPROBE(tcp_recvmsg_kretprobe, int ret)
{
	return exit_call(NETTAP_PROBE_TCP_RECVMSG, ret);
}

/* ---- lifecycle ---------------------------------------------------------- */

SEC("tracepoint/sock/inet_sock_set_state")
int tcp_state(struct trace_event_raw_inet_sock_set_state *ctx)
{
	struct nettap_capture_config *cfg;
	struct nettap_eof *e;
	struct conn *cn;
	__u64 key, id;
	__u32 zero = 0;

	if (ctx->newstate != TCP_CLOSE || ctx->protocol != IPPROTO_TCP)
		return 0;
	key = (__u64)ctx->skaddr;
	cn = bpf_map_lookup_elem(&capture_conns, &key);
	if (!cn)
		return 0;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	e = bpf_ringbuf_reserve(&capture_eof, sizeof(*e), 0);
	if (!e) {
		count_drop(NETTAP_RING_CAPTURE_EOF, 1);
	} else {
		id = bpf_get_current_pid_tgid();
		e->conn_id = cn->id;
		e->ts_ns = bpf_ktime_get_ns();
		e->start_ns = cn->start_ns;
		e->tx_bytes = cn->tx_off;
		e->rx_bytes = cn->rx_off;
		e->tx_calls = cn->tx_calls;
		e->rx_calls = cn->rx_calls;
		e->pid = cn->pid;
		e->tid = (__u32)id;
		e->oldstate = ctx->oldstate;
		e->pad0 = 0;
		read_addrs(KCAST(struct sock, ctx->skaddr), &e->family, &e->sport, &e->dport,
			   e->saddr, e->daddr);
		bpf_get_current_comm(e->comm, sizeof(e->comm));
		bpf_ringbuf_submit(e, wakeup_flags(&capture_eof, cfg));
	}
	if (!bpf_map_delete_elem(&capture_conns, &key))
		conns_live_add(-1);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
