/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * emit.bpf.h: the shared bodies of every mechanism's programs. An entry
 * remembers a captured call (enter_sock); its return counts it and
 * publishes its payload as chunks on capture_chunks (exit_call).
 *
 * `fast` is a compile-time constant chosen per program, never at run time:
 *   fast (Linux 6.2+): task-local storage (5.11), bpf_get_current_task_btf
 *     (5.11), bpf_loop (5.17), bpf_rdonly_cast (6.2), fetching atomics (5.12);
 *   compat (Linux 5.8+): a pid_tgid hash, bpf_get_current_task, an
 *     open-coded bounded loop, bpf_probe_read_kernel, plain atomic adds;
 *     bpf_loop in tcp.bpf.o (see emit_chunks), and where the kernel has it
 *     (struct nettap_kernel, set by user space) bpf_get_current_task_btf.
 * User space (exporter/kernel/features.py) loads one variant per program.
 */
#ifndef NETTAP_EMIT_BPF_H
#define NETTAP_EMIT_BPF_H

#include "filter.bpf.h"
#include "obs.bpf.h"
#include "tls.bpf.h"

/* Ring bytes one chunk takes: the record and its 8-byte ring header. */
#define CHUNK_STRIDE (sizeof(struct nettap_chunk) + 8)

#define FAST   true
#define COMPAT false

/* ---- the per-task call state --------------------------------------------- */

static __always_inline struct inflight *inflight_create(const bool fast)
{
	struct inflight *in, *zero_val;
	__u64 id;
	__u32 zero = 0;

	if (fast)
		return bpf_task_storage_get(&inflight_calls, bpf_get_current_task_btf(), 0,
					    BPF_LOCAL_STORAGE_GET_F_CREATE);
	id = bpf_get_current_pid_tgid();
	in = bpf_map_lookup_elem(&inflight_compat, &id);
	if (in)
		return in;
	zero_val = bpf_map_lookup_elem(&inflight_zero, &zero);
	if (!zero_val)
		return NULL;
	bpf_map_update_elem(&inflight_compat, &id, zero_val, BPF_NOEXIST);
	return bpf_map_lookup_elem(&inflight_compat, &id);
}

/* The thread's start, so that a thread reusing a dead one's id is told
 * apart: a direct load where the kernel has task BTF (5.11). */
static __always_inline __u64 task_start_time(void)
{
	struct task_struct *task;

	if (nettap_kernel.has_task_btf)
		return bpf_get_current_task_btf()->start_time;
	task = (void *)bpf_get_current_task();
	return BPF_CORE_READ(task, start_time);
}

static __always_inline struct inflight *inflight_find(__u64 id, const bool fast)
{
	struct inflight *in;

	if (fast)
		return bpf_task_storage_get(&inflight_calls, bpf_get_current_task_btf(), 0, 0);
	in = bpf_map_lookup_elem(&inflight_compat, &id);
	if (in && in->valid && in->task_start != task_start_time()) {
		/* Left by a dead thread whose id this one reuses. */
		bpf_map_delete_elem(&inflight_compat, &id);
		__sync_fetch_and_add(inflight_slot(id), -1);
		return NULL;
	}
	return in;
}

/* A call kept by its entry: valid, and counted in its thread's slot (both
 * only ever changed by the thread itself). */
static __always_inline void inflight_hold(struct inflight *in)
{
	if (!in->valid)
		__sync_fetch_and_add(inflight_slot(bpf_get_current_pid_tgid()), 1);
	in->valid = 1;
}

static __always_inline void inflight_release(struct inflight *in, __u64 pid_tgid)
{
	if (in->valid)
		__sync_fetch_and_add(inflight_slot(pid_tgid), -1);
	in->valid = 0;
}

/* A kernel-function entry the filter rejected: a state left valid by a
 * return that never ran (a kretprobe beyond its maxactive) must not be
 * taken for this call's at its return. */
static __always_inline void inflight_forget(const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct inflight *in;

	if (!*inflight_slot(id))
		return;
	in = inflight_find(id, fast);
	if (in)
		inflight_release(in, id);
}

/* The call returned: task storage keeps its slot (cleared), and so does the
 * hash where it allocates at run time (keep_inflight, Linux 6.1): the
 * thread's next captured call finds its entry with one lookup, where an
 * insert cost a lookup of the zero value, an allocation, a copy of ~650
 * bytes and a lookup, and the delete an unlink and a deferred free.
 * inflight_exit (lifecycle.bpf.c) removes the entry when the thread ends. A
 * preallocated hash (before 6.1: 4,096 entries, threads inside a captured
 * call at once) drops it now, so that it is not held by idle threads. */
static __always_inline void inflight_end(struct inflight *in, __u64 id, const bool fast)
{
	inflight_release(in, id);
	if (!fast && !nettap_kernel.keep_inflight)
		bpf_map_delete_elem(&inflight_compat, &id);
}

/* ---- entry --------------------------------------------------------------- */

/* Where a call's bytes are, as its entry saw them. */
struct call_data {
	__u64 buf;	 /* user buffer, or an iovec array */
	__u64 skip;	 /* bytes of the first iovec already consumed */
	__u32 iovcnt;	 /* 0: buf is a plain buffer */
	__u16 iter_type; /* kernel iterator type, when unreadable */
	__u8 iov_kernel; /* the iovec array is kernel memory */
	__u8 unreadable; /* no user buffer behind the call */
};

/* Count an entry on a captured TCP socket and remember the call until it
 * returns. */
static __always_inline int enter_sock(__u32 probe, struct sock *sk, struct call_data *d,
				      const bool fast)
{
	struct nettap_probe_counters *c = counters(probe);
	struct inflight *in;

	if (c)
		__sync_fetch_and_add(&c->calls, 1);
	in = inflight_create(fast);
	if (!in) {
		emit_log(NETTAP_LOG_INFLIGHT_FULL, probe, 0, 0, 0);
		return 0;
	}
	in->sk = (__u64)sk;
	in->buf = d->buf;
	in->iovcnt = d->iovcnt;
	in->skip = d->skip;
	in->iov_kernel = d->iov_kernel;
	in->unreadable = d->unreadable;
	in->iter_type = d->iter_type;
	in->task_start = fast ? 0 : task_start_time();
	in->probe = probe;
	inflight_hold(in);
	tls_learn(bpf_get_current_pid_tgid(), (__u64)sk);
	return 0;
}

/* ---- return: chunking ------------------------------------------------------ */

/* Publish one chunk of up to NETTAP_CHUNK_DATA bytes, or step to the next
 * iovec. Returns 1 to stop. */
static __always_inline long emit_step(struct inflight *in)
{
	struct emit_state *st = &in->st;
	struct nettap_chunk *rec;
	__u64 n;
	long err;

	if (st->done >= st->want)
		return 1;
	if (st->seg_left == 0) {
		struct iovec v = {};

		if (st->iov_left == 0)
			return 1;
		err = in->iov_kernel ? bpf_probe_read_kernel(&v, sizeof(v), (void *)st->iov)
				     : bpf_probe_read_user(&v, sizeof(v), (void *)st->iov);
		if (err)
			return 1;
		st->iov += sizeof(v);
		st->iov_left--;
		st->seg_base = (__u64)v.iov_base;
		st->seg_left = v.iov_len;
		if (st->skip) { /* the iterator's offset into its first iovec */
			n = st->skip < v.iov_len ? st->skip : v.iov_len;
			st->seg_base += n;
			st->seg_left -= n;
			st->skip = 0;
		}
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
		__builtin_memcpy(rec, &in->hdr, offsetof(struct nettap_chunk, data));
		rec->offset = in->hdr.call_offset + st->done;
		rec->len = n;
		err = bpf_probe_read_user(rec->data, n, (void *)st->seg_base);
		if (err) {
			__builtin_memset(rec->data, 0, sizeof(rec->data));
			rec->flags |= NETTAP_CHUNK_F_READ_FAILED;
			emit_log(NETTAP_LOG_READ_USER_FAILED, st->probe, in->hdr.h.conn_id,
				 (__u64)-err, n);
		}
		bpf_ringbuf_submit(rec, st->submit_flags);
		st->published++;
	}
	st->seg_base += n;
	st->seg_left -= n;
	st->done += n;
	return 0;
}

/* bpf_loop (Linux 5.17) callback: the verifier checks its body once; ctx
 * holds the caller's struct inflight pointer. */
static long emit_chunk_cb(__u32 i, void *ctx)
{
	return emit_step(*(struct inflight **)ctx);
}

/*
 * The compat programs chunk with bpf_loop (5.17; Linux 6.1 runs the compat
 * variant): the open-coded loop below costs the verifier tens of
 * milliseconds a program at load, bpf_loop's body is checked once. A program
 * that merely names bpf_loop's callback is refused before Linux 5.13 (the
 * callback is a subprogram such a kernel does not count: "number of funcs in
 * func_info doesn't match number of subprogs"), even where the call is never
 * reached, so the Makefile builds this file twice: tcp.bpf.o, and
 * tcp_open_loop.bpf.o (NETTAP_COMPAT_OPEN_LOOP) whose compat programs keep
 * the open-coded loop, for kernels without bpf_loop (exporter/kernel/loader.py
 * chooses).
 */
#ifdef NETTAP_COMPAT_OPEN_LOOP
#define COMPAT_BPF_LOOP 0
#else
#define COMPAT_BPF_LOOP 1
#endif

/* Chunks of the largest call, plus per iovec one step to read it and one
 * short chunk at its end. */
#define EMIT_STEPS (NETTAP_MAX_CHUNKS_PER_CALL + 2 * NETTAP_MAX_IOV)

static __always_inline void emit_chunks(struct inflight *in, const bool fast)
{
	/* compat too, but in tcp_open_loop.bpf.o (see COMPAT_BPF_LOOP). The
	 * flag, always set where tcp.bpf.o loads, keeps the open-coded loop in
	 * the compat programs for the verifier to prune: built without it,
	 * clang's registers for the single step's length lost their bounds on
	 * Linux 6.1's verifier ("R2 min value is negative"). */
	if (fast || (COMPAT_BPF_LOOP && nettap_kernel.has_bpf_loop)) {
		/* One buffer that fits one chunk (most calls): one step, without
		 * bpf_loop's helper call and callbacks. (The compat loop is
		 * open-coded already: its first step is as direct.) */
		if (in->st.seg_left >= in->st.want && in->st.want <= NETTAP_CHUNK_DATA)
			emit_step(in);
		else
			bpf_loop(EMIT_STEPS, emit_chunk_cb, &in, 0);
		return;
	}
	/* Bounded loop (Linux 5.3): the verifier walks each iteration, which
	 * stays cheap because the state lives in map memory. */
#pragma clang loop unroll(disable)
	for (int i = 0; i < EMIT_STEPS; i++)
		if (emit_step(in))
			break;
}

/* ---- return ---------------------------------------------------------------- */

/* Publish the ret bytes of a call on sk (in->buf, in->iovcnt, in->skip as
 * its entry saw them) as chunks of connection cn (NULL: none, conn_id 0),
 * starting at stream offset `at`. Counts the bytes and chunks in c. */
static __always_inline void emit_call(struct inflight *in, struct nettap_probe_counters *c,
				      struct nettap_capture_config *cfg, __u32 probe,
				      struct sock *sk, struct conn *cn, __u64 at, __u8 flags,
				      long ret, const bool fast)
{
	struct nettap_chunk *hdr = &in->hdr;
	struct emit_state *st = &in->st;
	__u64 id = bpf_get_current_pid_tgid();

	__sync_fetch_and_add(&c->bytes, ret);
	if (!conn_wants(cfg, cn, NETTAP_KIND_CHUNK)) /* the bytes counted, the offsets advanced */
		return;
	hdr->flags = flags;
	if (cn) {
		hdr->call_offset = at;
		hdr->h.conn_id = cn->id;
	} else {
		hdr->call_offset = 0;
		hdr->h.conn_id = 0;
		hdr->flags |= NETTAP_CHUNK_F_NO_CONN;
	}
	hdr->h.ts_ns = bpf_ktime_get_ns();
	hdr->h.kind = NETTAP_KIND_CHUNK;
	hdr->h.pid = id >> 32;
	hdr->call_len = ret;
	hdr->tid = (__u32)id;
	hdr->direction = (probe == NETTAP_PROBE_TCP_SENDMSG || probe == NETTAP_PROBE_SSL_WRITE ||
			  probe == NETTAP_PROBE_GO_TLS_WRITE)
				 ? NETTAP_DIR_EGRESS
				 : NETTAP_DIR_INGRESS;
	read_addrs(sk, fast, &hdr->ports, &hdr->addrs);
	bpf_get_current_comm(hdr->comm, sizeof(hdr->comm));

	if (in->unreadable) {
		/* Kernel pages behind the call (sendfile, splice): counted, and
		 * said once per call, but no chunk pretends to carry its bytes. */
		emit_log(NETTAP_LOG_PAYLOAD_UNREADABLE, probe, hdr->h.conn_id, in->iter_type, ret);
		return;
	}
	__builtin_memset(st, 0, sizeof(*st));
	st->probe = probe;
	/* One wakeup decision per call, not per chunk: a call's chunks land
	 * together, and the reader only needs waking once the ring fills. */
	st->want = ret;
	if (st->want > cfg->max_payload_bytes)
		st->want = cfg->max_payload_bytes;
	st->submit_flags = wakeup_flags_every(&capture_chunks, NETTAP_RING_CAPTURE_CHUNKS,
					      cfg->wakeup_bytes,
					      (st->want / NETTAP_CHUNK_DATA + 1) * CHUNK_STRIDE,
					      cfg->wakeup_check_bytes);
	if (in->iovcnt == 0) {
		st->seg_base = in->buf;
		st->seg_left = ret;
	} else {
		st->iov = in->buf;
		st->iov_left = in->iovcnt > NETTAP_MAX_IOV ? NETTAP_MAX_IOV : in->iovcnt;
		st->skip = in->skip;
	}

	emit_chunks(in, fast);
	if (st->done < st->want) /* more than NETTAP_MAX_IOV iovecs, or one unreadable */
		emit_log(NETTAP_LOG_IOV_TRUNCATED, probe, hdr->h.conn_id, in->iovcnt,
			 st->want - st->done);

	__sync_fetch_and_add(&c->chunks, st->published);
	if (st->dropped)
		count_drop(NETTAP_RING_CAPTURE_CHUNKS, st->dropped);
}

/* A TLS call (libssl's, Go's) returned having moved bytes of plaintext from
 * or to buf, on socket sk of connection cn (NULL: none): counted, and
 * published as chunks with the TLS offsets of cn. */
static __always_inline void tls_publish(struct nettap_capture_config *cfg, __u32 probe, __u64 skp,
					struct conn *cn, __u64 buf, __u64 bytes, __u8 flags,
					const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid(), at = 0;
	struct nettap_probe_counters *c = counters(probe);
	struct inflight *in;
	struct sock *sk;

	if (!c)
		return;
	__sync_fetch_and_add(&c->calls, 1);
	__sync_fetch_and_add(&c->returns, 1);
	if (!bytes || bytes > 0x7fffffff)
		return;
	sk = fast ? KCAST(struct sock, skp) : (struct sock *)skp;
	if (cn && cn->pending)
		conn_kept(cn);
	if (cn)
		at = conn_advance(cn, probe, bytes, fast);
	/* The thread's TCP call scratch: no TCP call is in flight in user space. */
	in = inflight_create(fast);
	if (!in)
		return;
	in->buf = buf;
	in->iovcnt = 0;
	in->skip = 0;
	in->iov_kernel = 0;
	in->unreadable = 0;
	emit_call(in, c, cfg, probe, sk, cn, at, flags, bytes, fast);
	inflight_end(in, id, fast);
}

/* ring dlopen: the current process maps (or runs) file: told, so that user
 * space attaches the TLS uprobes to the file if it has not yet. */
static __always_inline void dlopen_submit(struct file *file)
{
	struct nettap_dlopen *r;
	struct inode *inode;
	__u64 id;

	r = bpf_ringbuf_reserve(&dlopen, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_DLOPEN, 1);
		return;
	}
	id = bpf_get_current_pid_tgid();
	inode = BPF_CORE_READ(file, f_inode);
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = 0;
	r->h.kind = NETTAP_KIND_DLOPEN;
	r->h.pid = id >> 32;
	r->ino = BPF_CORE_READ(inode, i_ino);
	r->dev = BPF_CORE_READ(inode, i_sb, s_dev);
	r->tid = (__u32)id;
	bpf_get_current_comm(r->comm, sizeof(r->comm));
	__builtin_memset(r->name, 0, sizeof(r->name));
	bpf_probe_read_kernel_str(r->name, sizeof(r->name),
				  BPF_CORE_READ(file, f_path.dentry, d_name.name));
	bpf_ringbuf_submit(r, 0);
}

static __always_inline int exit_call(__u32 probe, long ret, const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid(), at = 0;
	struct nettap_capture_config *cfg;
	struct inflight *in;
	struct nettap_probe_counters *c;
	struct conn *cn;
	struct sock *sk;
	__u32 zero = 0;

	/* Every return on the node runs this: leave on one load when the
	 * thread's slot holds no call (the common case, a call not kept). */
	if (!*inflight_slot(id))
		return 0;
	in = inflight_find(id, fast);
	if (!in || !in->valid || in->probe != probe)
		return 0;
	c = counters(probe);
	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	if (!c || !cfg)
		goto out;
	__sync_fetch_and_add(&c->returns, 1);
	if (ret <= 0)
		goto out;

	sk = fast ? KCAST(struct sock, in->sk) : (struct sock *)in->sk;
	cn = conn_get(in->sk, probe, fast);
	if (cn && cn->pending)
		conn_kept(cn);
	if (cn) {
		if (!cn->owned) { /* its first captured call, and no connect named its owner */
			if (!cn->pid) /* decided in softirq (lifecycle.bpf.c): its owner is this caller */
				cn->pid = id >> 32;
			publish_owner(sk, cn, NETTAP_VIA_FIRST_CALL, fast);
		}
		at = conn_advance(cn, probe, ret, fast);
	}
	emit_call(in, c, cfg, probe, sk, cn, at, 0, ret, fast);
out:
	inflight_end(in, id, fast);
	return 0;
}

#endif /* NETTAP_EMIT_BPF_H */
