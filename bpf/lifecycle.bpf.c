// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * lifecycle.bpf.c: the lifecycle programs, probe tcp_state (states, eof,
 * resets, destruction, threads' ends), and the probes of their own tcp_accept
 * and tcp_sk_error.
 */
#include "entry_tp.bpf.h"
#include "timer.bpf.h"
#include "timewait.bpf.h"

/* Publish a captured connection's totals and forget it; nothing when the
 * socket is not in the table. One body for both lifecycle programs: it runs
 * once per captured connection, so its reads go through
 * bpf_probe_read_kernel and its adds do not fetch. */
static __always_inline void publish_eof(const struct sock *sk, struct conn *cn, int oldstate)
{
	struct nettap_capture_config *cfg;
	struct nettap_eof *e;
	__u32 zero = 0;
	__u64 id;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	if (!conn_wants(cfg, cn, NETTAP_KIND_EOF))
		return;
	e = bpf_ringbuf_reserve(&capture_eof, sizeof(*e), 0);
	if (!e) {
		count_drop(NETTAP_RING_CAPTURE_EOF, 1);
	} else {
		id = bpf_get_current_pid_tgid();
		e->h.ts_ns = bpf_ktime_get_ns();
		e->h.conn_id = cn->id;
		e->h.kind = NETTAP_KIND_EOF;
		e->h.pid = cn->pid;
		e->start_ns = cn->start_ns;
		e->tx_bytes = cn->tx_off;
		e->rx_bytes = cn->rx_off;
		e->tx_calls = cn->tx_calls;
		e->rx_calls = cn->rx_calls;
		e->tid = (__u32)id;
		e->oldstate = oldstate;
		e->pad0 = 0;
		e->established_us = cn->established_us;
		read_addrs((struct sock *)sk, false, &e->ports, &e->addrs);
		bpf_get_current_comm(e->comm, sizeof(e->comm));
		bpf_ringbuf_submit(e, cfg ? wakeup_flags(&capture_eof, NETTAP_RING_CAPTURE_EOF,
							 cfg->eof_wakeup_bytes)
					  : BPF_RB_NO_WAKEUP);
	}
}

static __always_inline void conn_forget(const struct sock *sk)
{
	conn_delete((__u64)sk);
}

/* Capture decided at a socket's first state: an active open (CLOSE ->
 * SYN_SENT) runs in the connecting task, so every target applies; a passive
 * one (LISTEN -> SYN_RECV, the child socket) runs in softirq, where the
 * current task means nothing, so only the socket targets (port, netns) do, and
 * the owner is learnt at its first captured call. Any other socket is
 * captured from its first captured call (emit.bpf.h). Under
 * capture.sample_connections the tuple may not be whole yet: a connect's
 * local port is bound after this state, and before Linux 6.x a child's peer
 * is set after its birth. Its entry then waits, pending (with the connecting
 * task's identity), for the next event of its life, which decides
 * (obs.bpf.h: captured_conn). */
static __always_inline struct conn *state_decide(const struct sock *sk, int oldstate, int newstate,
						 const bool fetch)
{
	struct nettap_capture_config *cfg;
	struct conn *cn;
	bool active = oldstate == TCP_CLOSE && newstate == TCP_SYN_SENT;
	__u8 pending = 0;

	if (!active && !(oldstate == TCP_LISTEN && newstate == TCP_SYN_RECV))
		return NULL;
	cfg = active_config();
	if (!cfg)
		return NULL;
	/* sk is a BTF pointer here (tp_btf): direct loads on every kernel. */
	if (!(active && task_matches(cfg)) && !sock_matches(cfg, (struct sock *)sk, true))
		return NULL;
	if (cfg->sample_threshold && (!sk->__sk_common.skc_num || !sk->__sk_common.skc_dport))
		pending = active ? CONN_PENDING_CONNECT : CONN_PENDING_BIRTH;
	else if (!sample_keep(cfg, (struct sock *)sk, true)) {
		obs_count(NETTAP_OBS_SAMPLED);
		return NULL;
	}
	cn = conn_get((__u64)sk, NETTAP_PROBE_TCP_SENDMSG, fetch);
	if (!cn)
		return NULL;
	cn->pending = pending;
	if (!active) {
		cn->pid = 0;
		cn->wants = target_kinds(sk, true, false);
	} else if (pending) {
		__u64 id = bpf_get_current_pid_tgid();

		cn->wants = target_kinds(sk, true, true);
		cn->connector.cgroup_id = bpf_get_current_cgroup_id();
		cn->connector.tid = (__u32)id;
		bpf_get_current_comm(cn->connector.comm, sizeof(cn->connector.comm));
	}
	return cn;
}

/* ring obs_events: the state change of a captured socket. */
static __always_inline void publish_state(const struct sock *sk, struct conn *cn, int oldstate,
					  int newstate)
{
	obs_count(NETTAP_OBS_STATES + (oldstate & 15) * 16 + (newstate & 15));
	state_record(sk, cn, oldstate, newstate, 0);
}

static __always_inline int on_state(const struct sock *sk, int oldstate, int newstate,
				    const bool fetch)
{
	struct conn *cn;

	if (fetch) /* the fast variant: verified 6x faster (core_fixes.bpf.h) */
		sk = UNTRUSTED(struct sock, sk);
	if (sk->sk_protocol != IPPROTO_TCP)
		return 0;
	cn = captured_conn(sk);
	if (cn && cn->closed) { /* used again after TCP_CLOSE (connect, listen): a new life */
		conn_forget(sk);
		cn = NULL;
	}
	if (!cn)
		cn = state_decide(sk, oldstate, newstate, fetch);
	if (!cn || cn->pending)
		return 0;
	/* Decided at its connect, in the connecting task: its owner first. */
	if (!cn->owned && cn->pid)
		publish_owner(sk, cn, NETTAP_VIA_CONNECT, false);
	publish_state(sk, cn, oldstate, newstate);
	timewait_pending_state(sk, cn, oldstate, newstate); /* the TIME_WAIT socket it may leave */
	if (newstate == TCP_ESTABLISHED && !cn->established_us) {
		__u64 us = (bpf_ktime_get_ns() - cn->start_ns) / 1000;

		cn->established_us = us ? (us < 0xffffffff ? us : 0xffffffff) : 1;
	}
	if (newstate == TCP_CLOSE) {
		publish_eof(sk, cn, oldstate);
		cn->closed = 1;
	}
	return 0;
}

/* A captured socket changed state: its state record; at TCP_CLOSE, its
 * connection's totals (the entry stays, closed, until the socket is
 * destroyed: a reset the socket sends comes after its CLOSE).
 *
 * A BTF raw tracepoint, not the classic tracepoint of the same name: the
 * classic one shares the per-CPU bpf_prog_active guard with every tracing
 * program, so when TCP_CLOSE is reached in a softirq that interrupted any
 * BPF program on that CPU (the send-path programs run on every syscall),
 * the kernel skips this run silently. A raw tracepoint's guard is per
 * program: it is skipped only when a softirq interrupts this very program,
 * and the kernel counts that (the program's misses). tcp_destroy below
 * catches what such a skipped run leaves. Needs vmlinux BTF, nettap's floor. */
NETTAP_PROG("probe=tcp_state variant=fast mech=tp_btf")
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(tcp_state, const struct sock *sk, int oldstate, int newstate)
{
	return on_state(sk, oldstate, newstate, FAST);
}

/* The same, with the connection ids of the compat programs (no fetching
 * add before Linux 5.12: conn_get). */
NETTAP_PROG("probe=tcp_state variant=compat mech=tp_btf")
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(tcp_state_compat, const struct sock *sk, int oldstate, int newstate)
{
	return on_state(sk, oldstate, newstate, COMPAT);
}

/* ring obs_events: a captured socket's destruction, with the kernel's own
 * totals for it (struct tcp_sock). */
static __always_inline void publish_destroy(const struct sock *sk, struct conn *cn)
{
	const struct tcp_sock *tp = (const struct tcp_sock *)sk;
	struct nettap_destroy *r;

	r = obs_reserve(sizeof(*r), NETTAP_KIND_DESTROY, cn);
	if (!r)
		return;
	r->bytes_acked = BPF_CORE_READ(tp, bytes_acked);
	r->bytes_received = BPF_CORE_READ(tp, bytes_received);
	r->segs_out = BPF_CORE_READ(tp, segs_out);
	r->segs_in = BPF_CORE_READ(tp, segs_in);
	r->total_retrans = BPF_CORE_READ(tp, total_retrans);
	OBS_STATE(r, sk);
	OBS_SOCK(r, sk, false);
	obs_submit(r);
}

/* The socket is destroyed (tcp_v4_destroy_sock, IPv6 too): its destroy
 * record, and whatever entry it still has goes now, so no later socket at
 * this address inherits it. An entry not yet closed publishes its eof here:
 * tcp_state's run at TCP_CLOSE was skipped by the kernel (its own guard; a
 * separate program has a separate one), or data still queued after
 * TCP_CLOSE (a peer reset) was read, a connection of its own (conn_get).
 * That eof carries oldstate TCP_CLOSE: the state before close is not known
 * here. */
NETTAP_PROG("probe=tcp_state mech=tp_btf")
SEC("tp_btf/tcp_destroy_sock")
int BPF_PROG(tcp_destroy, struct sock *sk)
{
	struct conn *cn = captured_conn(sk);
	struct nettap_timer_slot *slot;

	if (!cn)
		return 0;
	slot = timer_slot_get(); /* destroyed by its timer, which must not read it after */
	if (slot && slot->timer && slot->sk == (__u64)sk)
		timer_slot_clear(slot);
	if (!cn->closed)
		publish_eof(sk, cn, TCP_CLOSE);
	publish_destroy(sk, cn);
	conn_forget(sk);
	return 0;
}

/* ring obs_events: a reset sent or received by a captured socket. */
static __always_inline int publish_reset(const struct sock *sk, __u8 direction)
{
	struct nettap_reset *r;
	struct conn *cn;

	if (!sk) /* Linux 6.10+: a reset for no socket */
		return 0;
	cn = captured_conn(sk);
	if (!cn) /* not captured (a timewait or request socket is never in the table) */
		return 0;
	obs_count(NETTAP_OBS_RESETS + direction);
	r = obs_reserve(sizeof(*r), NETTAP_KIND_RESET, cn);
	if (!r)
		return 0;
	r->direction = direction;
	OBS_STATE(r, sk);
	obs_sock(sk, false, &r->ports, &r->addrs, &r->netns);
	obs_submit(r);
	return 0;
}

/* A reset sent: (sk, skb) on every kernel; Linux 6.10 added a reason, not
 * read here, and lets sk be NULL (a reset for no socket) or a timewait or
 * request socket. */
NETTAP_PROG("probe=tcp_state mech=tp_btf")
SEC("tp_btf/tcp_send_reset")
int BPF_PROG(tcp_rst_sent, const struct sock *sk)
{
	return publish_reset(sk, NETTAP_DIR_EGRESS);
}

NETTAP_PROG("probe=tcp_state mech=tp_btf")
SEC("tp_btf/tcp_receive_reset")
int BPF_PROG(tcp_rst_recv, struct sock *sk)
{
	return publish_reset(sk, NETTAP_DIR_INGRESS);
}

/* A thread ends (do_exit, in the thread itself): a call it was killed
 * inside no longer counts in its slot (inflight_slots: the return programs of
 * the threads sharing it would look their state up at every return), and the
 * compat programs' entry for it goes (kept between its calls: inflight_end).
 * The fast programs' task storage goes with the task. The TLS calls it was
 * killed inside go too (tls_thread_end), in both variants. */
static __always_inline int on_thread_exit(const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct inflight *in;

	tls_thread_end(id);
	if (fast) {
		in = bpf_task_storage_get(&inflight_calls, bpf_get_current_task_btf(), 0, 0);
		if (in)
			inflight_release(in, id);
		return 0;
	}
	in = bpf_map_lookup_elem(&inflight_compat, &id);
	if (!in)
		return 0;
	inflight_release(in, id);
	bpf_map_delete_elem(&inflight_compat, &id);
	return 0;
}

NETTAP_PROG("probe=tcp_state variant=fast mech=tp_btf")
SEC("tp_btf/sched_process_exit")
int BPF_PROG(inflight_exit)
{
	return on_thread_exit(FAST);
}

NETTAP_PROG("probe=tcp_state variant=compat mech=tp_btf")
SEC("tp_btf/sched_process_exit")
int BPF_PROG(inflight_exit_compat)
{
	return on_thread_exit(COMPAT);
}

/* An accepted socket, in the accepting task (accept4(2), accept(2) return
 * its fd): its owner, and its capture decided here when a task target (pid,
 * cgroup) names the accepting process, which its birth in softirq (LISTEN ->
 * SYN_RECV) could not tell; its state lines start here then. A socket
 * already captured with its owner known (a call before accept returned to
 * user space) is left as it is. */
static __always_inline int on_accept(long fd, const bool fast)
{
	struct nettap_capture_config *cfg;
	struct sock *sk;
	struct conn *cn;

	if (fd < 0)
		return 0;
	cfg = active_config();
	if (!cfg)
		return 0;
	sk = matched_fd_sock(cfg, fd, fast);
	if (!sk)
		return 0;
	if (!sample_keep(cfg, sk, fast)) {
		/* counted here when only a task target names it (its birth
		 * counted it when a socket target did) */
		if (!sock_matches(cfg, sk, fast))
			obs_count(NETTAP_OBS_SAMPLED);
		return 0;
	}
	/* conn_get's log names a probe: an accept is the receive side's */
	cn = conn_get((__u64)sk, NETTAP_PROBE_TCP_RECVMSG, fast);
	if (!cn || cn->owned)
		return 0;
	cn->pid = bpf_get_current_pid_tgid() >> 32;
	publish_owner(sk, cn, NETTAP_VIA_ACCEPT, fast);
	return 0;
}

/* Attached by user space to sys_exit_accept4 and sys_exit_accept. */
// clang-format off
NETTAP_TP("tracepoint/syscalls/sys_exit_accept4", tcp_accept, struct trace_event_raw_sys_exit,
	  "probe=tcp_accept attach=sys_exit_accept4,sys_exit_accept records=owner", {
	return on_accept(ctx->ret, fast);
})
// clang-format on

/* A captured socket reported an error (sk_err: a refused or timed-out
 * connect, a reset, an ICMP error). The tracepoint is Linux 5.14's: the
 * loader loads this program only where the kernel has it (features.py). */
NETTAP_PROG("probe=tcp_sk_error needs=sock:inet_sk_error_report mech=tp_btf records=error")
SEC("tp_btf/inet_sk_error_report")
int BPF_PROG(tcp_sk_error, const struct sock *sk)
{
	struct nettap_error *r;
	struct conn *cn;
	int err;

	if (sk->sk_protocol != IPPROTO_TCP) /* any inet socket's */
		return 0;
	cn = captured_conn(sk);
	if (!cn)
		return 0;
	/* tcp_disconnect reports too, after the error was read (a failed connect's): no error */
	err = BPF_CORE_READ(sk, sk_err);
	if (err <= 0)
		return 0;
	obs_count(NETTAP_OBS_ERRORS + (err < 255 ? err : 255));
	r = obs_reserve(sizeof(*r), NETTAP_KIND_ERROR, cn);
	if (!r)
		return 0;
	r->errno = err;
	r->errno_name = err;
	OBS_STATE(r, sk);
	OBS_SOCK(r, sk, false);
	obs_submit(r);
	return 0;
}
