// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * request.bpf.c: the request sockets of captured listeners, probe
 * tcp_request: tp_btf on the timer wheel's tracepoints, as the TIME_WAIT
 * sockets' (timewait.bpf.c). A request's life is its rsk_timer's
 * (net/ipv4/inet_connection_sock.c): started as a SYN makes it and its
 * SYN-ACK goes out (reqsk_queue_hash_req: timer:timer_start, function
 * reqsk_timer_handler); each time it fires, reqsk_timer_handler sends the
 * SYN-ACK again and starts it again, or drops the request (tcp_synack_retries
 * spent, or its listener closed); detached early (timer:timer_cancel) as
 * the request ends otherwise: inet_csk_complete_hashdance (its ACK came:
 * its socket made), tcp_check_req (a reset, or a segment it refused),
 * tcp_v4_rcv or tcp_v6_rcv (its listener no longer listening), told by the
 * kernel stack, the request already unhashed (a detach while it is still
 * hashed is a restart: a SYN sent again, tcp_check_req's mod_timer_pending).
 * A request whose ACK came while the accept queue was full
 * stays, marked acked (tcp_check_req, tcp_abort_on_overflow 0): its drop
 * at its timeout is an overflow (but for a TCP_DEFER_ACCEPT listener's bare
 * ACK, acked too: request_dropped_as).
 *
 * A SYN answered with a SYN cookie, or dropped with the SYN or accept
 * queue full, makes no request socket and passes no tracepoint (the kernel
 * only counts it: TcpExtSyncookiesSent, TcpExtListenDrops). Seen all the
 * same (tcp_request_state): a cookie as its ACK comes back valid and makes
 * the socket (cookie_v4_check on the stack at the child's birth; a cookie
 * whose ACK never comes is not seen), and the drops as the listener's own
 * count of them (sk_drops, tcp_listendrop), read at each request it makes
 * and as it closes. That count holds more than the SYNs its full queues
 * refused: every segment to one of its requests that tcp_check_req answers
 * without a socket (a SYN sent again, a held-back or refused ACK: an ACK
 * the full accept queue refuses counts twice, tcp_listendrop then the
 * discard), and a reset to a request.
 */
#include "timewait.bpf.h"

/* A captured listener's request, by its address: what its records say
 * (kept here: a request timed out is freed by its timer's function, before
 * its end is told). */
struct request {
	__u64 made_ns;
	struct nettap_ports ports;
	__u8 retransmits; /* SYN-ACKs sent again, at its timer's last start */
	__u8 pad;
	struct nettap_netns_addrs at;
	__u32 wants; /* the record kinds its listener's targets ask for (target_kinds) */
};

/* Sized for 16,384 at once (an accept queue's SYN backlog is
 * tcp_max_syn_backlog, 128 to 4,096 by memory, per listener); an insert
 * refused is counted (map_insert_failures, NETTAP_MAP_REQUESTS). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct request);
} request_socks NETTAP_MAP("prealloc_max=4096") SEC(".maps");

/* A captured listener's drops (sk_drops) counted so far, by its address:
 * from its listen, or from the first request it made that nettap saw (what
 * it dropped before is not counted). Sized for 4,096 captured listeners at
 * once; an insert refused is counted (map_insert_failures,
 * NETTAP_MAP_LISTENERS): that listener's drops are not. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u32);
} request_listeners NETTAP_MAP("prealloc_max=1024") SEC(".maps");

/* The followed request whose timer this CPU's wheel is firing, from its
 * detach to its function's return: started again (rearmed) or dropped. */
struct request_slot {
	__u64 timer;
	__u64 req;
	__u8 rearmed;
	__u8 outcome; /* if dropped: timeout, overflow (acked) or closed */
	__u8 pad[6];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct request_slot);
} request_slot SEC(".maps");

/* Entries of request_socks, and CPUs whose slot holds a timer: the timer
 * programs look no further while they are 0. Written by these programs
 * alone: user space zeroes them as it empties request_socks, request_slot
 * and request_listeners, the programs detached (exporter/kernel/followed.py). */
__u32 requests_tracked SEC(".bss.requests");
__u32 request_slots_armed SEC(".bss.requests");

#define TCP_SYN_RECV_STATE 3
#define TCP_CLOSE_STATE	   7
#define TCP_LISTEN_STATE   10

static __always_inline __u64 timer_req(const struct timer_list *timer)
{
	return (__u64)timer - bpf_core_field_offset(struct request_sock, rsk_timer);
}

static __always_inline struct request_slot *request_slot_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&request_slot, &zero);
}

/* Is a request still in the established hash (its skc_nulls_node linked)? */
static __always_inline bool request_hashed(__u64 req)
{
	return BPF_CORE_READ((const struct sock *)req, __sk_common.skc_nulls_node.pprev) != 0;
}

/* ring obs_events: a request made or ended (no connection: conn_id, pid 0). */
static __always_inline void request_record(const struct request *e, __u8 outcome, __u32 timeout,
					   __u32 age_ms)
{
	struct nettap_request *r;

	if (e->wants ? !(e->wants & (1U << NETTAP_KIND_REQUEST))
		     : !kind_wanted(active_config(), NETTAP_KIND_REQUEST))
		return;
	r = bpf_ringbuf_reserve(&obs_events, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_OBS_EVENTS, 1);
		return;
	}
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = 0;
	r->h.kind = NETTAP_KIND_REQUEST;
	r->h.pid = 0;
	r->timeout_jiffies = timeout;
	r->age_ms = age_ms;
	r->ports = e->ports;
	r->outcome = outcome;
	r->retransmits = e->retransmits;
	r->at = e->at;
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	obs_submit(r);
}

/* A followed request ended: counted, its record, forgotten. */
static __always_inline void request_end(__u64 req, __u8 outcome, long left)
{
	struct request *found = bpf_map_lookup_elem(&request_socks, &req);
	struct request e;

	if (!found)
		return;
	e = *found;
	if (bpf_map_delete_elem(&request_socks, &req)) /* another CPU's end */
		return;
	__sync_fetch_and_add(&requests_tracked, -1);
	obs_count(NETTAP_OBS_REQUESTS + outcome);
	request_record(&e, outcome, left > 0 ? left : 0,
		       (bpf_ktime_get_ns() - e.made_ns) / 1000000);
}

/* What a listener dropped: SYNs, its SYN or accept queue full
 * (tcp_listendrop), and the segments its requests refused. */
static __always_inline __u32 listener_drops(const struct sock *lsn)
{
	const struct numa_drop_counters *ndc;
	__u32 n = BPF_CORE_READ(lsn, sk_drops.counter);

	if (bpf_core_field_exists(lsn->sk_drop_counters)) {
		ndc = BPF_CORE_READ(lsn, sk_drop_counters);
		if (ndc)
			n += BPF_CORE_READ(ndc, drops0.counter) +
			     BPF_CORE_READ(ndc, drops1.counter);
	}
	return n;
}

/* Count what a captured listener dropped since it was last counted (a new
 * one: from now on); gone (it closed): forget it. Two CPUs counting one
 * listener at once may both count its latest drops (no compare-and-swap
 * before Linux 5.12): the sum then runs ahead, and its next drops are not
 * counted until the listener's own count catches up. */
static __always_inline void listener_count(const struct sock *lsn, bool gone)
{
	__u64 key = (__u64)lsn;
	__u32 now = listener_drops(lsn), *seen;
	__s32 more;

	seen = bpf_map_lookup_elem(&request_listeners, &key);
	if (!seen) {
		if (!gone && bpf_map_update_elem(&request_listeners, &key, &now, BPF_NOEXIST) &&
		    !bpf_map_lookup_elem(&request_listeners, &key))
			count_insert_failure(NETTAP_MAP_LISTENERS);
		return;
	}
	more = (__s32)(now - *seen);
	if (more > 0) {
		__sync_fetch_and_add(seen, more);
		obs_add(NETTAP_OBS_REQUESTS + NETTAP_REQ_LISTEN_DROP, more);
	}
	if (gone)
		bpf_map_delete_elem(&request_listeners, &key);
}

/* A captured listener starts listening: its drops counted from now on (an
 * entry left at its address by a listener whose close was not seen, the
 * programs detached then, is replaced). */
static __always_inline void listener_start(const struct sock *lsn)
{
	__u64 key = (__u64)lsn;
	__u32 now = listener_drops(lsn);

	if (bpf_map_update_elem(&request_listeners, &key, &now, BPF_ANY))
		count_insert_failure(NETTAP_MAP_LISTENERS);
}

#define REQ_STACK 16

/* Why a request's timer is detached now: the NETTAP_REQ_* of the innermost
 * kernel-stack frame in one of nettap_ksyms.req_callers, or 0 (none: it
 * fires). */
static __always_inline __u8 request_cause(void *ctx)
{
	const __u64 *c = nettap_ksyms.req_callers;
	__u64 stack[REQ_STACK];
	long n;

	n = bpf_get_stack(ctx, stack, sizeof(stack), 0);
	if (n <= 0)
		return 0;
	n /= sizeof(__u64);
	for (int i = 0; i < REQ_STACK; i++) {
		if (i >= n)
			break;
		for (int j = 0; j < NETTAP_KSYM_REQ_CALLERS; j++)
			if (stack[i] >= c[j * 3] && stack[i] < c[j * 3 + 1])
				return c[j * 3 + 2];
	}
	return 0;
}

/* A request's timer started (tcp_request, past its first compare): a new
 * request of a captured listener (its first start: no timeout yet) is
 * followed from here; a followed one's
 * start is its handler sending its SYN-ACK again. fast: the request read
 * by direct loads (bpf_rdonly_cast, Linux 6.2), else by helper calls. */
static __always_inline int on_request_start(struct timer_list *timer, const bool fast)
{
	struct nettap_capture_config *cfg;
	struct request_slot *slot;
	struct request *found, e;
	struct sock *req;
	__u64 key;
	long left;

	key = timer_req(timer);
	req = (struct sock *)key;
	if (requests_tracked) {
		found = bpf_map_lookup_elem(&request_socks, &key);
		if (found) {
			found->retransmits = BPF_CORE_READ((struct request_sock *)req, num_retrans);
			slot = request_slot_get();
			if (slot && slot->timer == (__u64)timer)
				slot->rearmed = 1;
			return 0;
		}
	}
	/* a captured listener's first: a request of another listener costs
	 * its ports, two loads (fast) or a helper call (~52 ns here:
	 * bench/steps.py) */
	cfg = active_config();
	if (!cfg || !sock_matches(cfg, fast ? KCAST(struct sock, key) : req, fast))
		return 0;
	if (BPF_CORE_READ_BITFIELD_PROBED((struct request_sock *)req, num_timeout))
		return 0;
	listener_count(BPF_CORE_READ(req, __sk_common.skc_listener), false);
	if (!sample_keep(cfg, req, false))
		return 0;
	__builtin_memset(&e, 0, sizeof(e)); /* here: not on every timer's way out */
	e.made_ns = bpf_ktime_get_ns();
	e.wants = target_kinds(req, false, false);
	obs_sock(req, false, &e.ports, &e.at.addrs, &e.at.netns);
	if (bpf_map_update_elem(&request_socks, &key, &e, BPF_NOEXIST)) {
		count_insert_failure(NETTAP_MAP_REQUESTS);
		return 0;
	}
	__sync_fetch_and_add(&requests_tracked, 1);
	obs_count(NETTAP_OBS_REQUESTS + NETTAP_REQ_MADE);
	left = (long)(timer->expires - bpf_jiffies64());
	request_record(&e, NETTAP_REQ_MADE, left > 0 ? left : 0, 0);
	return 0;
}

/* on_request_start's two variants, each a subprogram (timer.bpf.h) */
static __noinline int request_started(struct timer_list *timer)
{
	return on_request_start(timer, true);
}

static __noinline int request_started_compat(struct timer_list *timer)
{
	return on_request_start(timer, false);
}

/* Every timer of the node started: no for all but requests', here. */
NETTAP_PROG("probe=tcp_request variant=fast mech=tp_btf records=request")
SEC("tp_btf/timer_start")
int BPF_PROG(tcp_request, struct timer_list *timer)
{
	if ((__u64)timer->function != nettap_ksyms.req_timer_handler)
		return 0;
	return request_started(timer);
}

NETTAP_PROG("probe=tcp_request variant=compat mech=tp_btf records=request")
SEC("tp_btf/timer_start")
int BPF_PROG(tcp_request_compat, struct timer_list *timer)
{
	if ((__u64)timer->function != nettap_ksyms.req_timer_handler)
		return 0;
	return request_started_compat(timer);
}

/* What a request is dropped as if its timer's function drops it now: its
 * listener closed; an overflow, its ACK came with the accept queue full
 * (acked); or a timeout. acked is also a bare ACK a TCP_DEFER_ACCEPT
 * listener held back (tcp_check_req), waiting for data: a request of such a
 * listener is an overflow only with its accept queue full now. */
static __always_inline __u8 request_dropped_as(const struct request_sock *req)
{
	const struct sock *lsn = BPF_CORE_READ((const struct sock *)req, __sk_common.skc_listener);

	if (BPF_CORE_READ(lsn, __sk_common.skc_state) != TCP_LISTEN_STATE)
		return NETTAP_REQ_CLOSED;
	if (!BPF_CORE_READ_BITFIELD_PROBED((const struct inet_request_sock *)req, acked))
		return NETTAP_REQ_TIMEOUT;
	if (BPF_CORE_READ((const struct inet_connection_sock *)lsn,
			  icsk_accept_queue.rskq_defer_accept) &&
	    BPF_CORE_READ(lsn, sk_ack_backlog) <= BPF_CORE_READ(lsn, sk_max_ack_backlog))
		return NETTAP_REQ_TIMEOUT;
	return NETTAP_REQ_OVERFLOW;
}

/* A request's timer detached (tcp_request_end, past its first compare):
 * a followed one ended early (request_cause), or about to fire, kept in
 * this CPU's slot for tcp_request_exit. */
static __noinline int request_detached(void *ctx, const struct timer_list *timer)
{
	const struct request_sock *req;
	struct request_slot *slot;
	__u64 key;
	long left;
	__u8 outcome;

	key = timer_req(timer);
	if (!bpf_map_lookup_elem(&request_socks, &key))
		return 0;
	left = (long)(timer->expires - bpf_jiffies64());
	outcome = request_cause(ctx);
	/* Every end unhashes the request before it detaches its timer
	 * (reqsk_queue_unlink): one still hashed is restarted, as a SYN sent
	 * again makes tcp_check_req move it (mod_timer_pending: timer_start
	 * follows), or fires now (no cause, its expiry come). One unhashed ends
	 * now, killed where the stack names no cause (or cannot be read). */
	if (!request_hashed(key)) {
		request_end(key, outcome ? outcome : NETTAP_REQ_KILLED, left);
		return 0;
	}
	if (outcome || left > 0)
		return 0;
	slot = request_slot_get();
	if (!slot)
		return 0;
	req = (const struct request_sock *)key;
	if (!slot->timer)
		__sync_fetch_and_add(&request_slots_armed, 1);
	slot->timer = (__u64)timer;
	slot->req = key;
	slot->rearmed = 0;
	slot->outcome = request_dropped_as(req);
	return 0;
}

/* Every timer of the node detached: no for all but requests' while one is
 * followed, here; the rest is request_detached (timer.bpf.h). */
NETTAP_PROG("probe=tcp_request mech=tp_btf records=request")
SEC("tp_btf/timer_cancel")
int BPF_PROG(tcp_request_end, struct timer_list *timer)
{
	if ((__u64)timer->function != nettap_ksyms.req_timer_handler || !requests_tracked)
		return 0;
	return request_detached(ctx, timer);
}

/* A timer's function returned while a slot is armed (tcp_request_exit,
 * past its first compare): a followed request it did not start again is
 * dropped. */
static __noinline int request_timer_returned(const struct timer_list *timer)
{
	struct request_slot *slot;
	__u8 rearmed, outcome;
	__u64 req;

	slot = request_slot_get();
	if (!slot || !slot->timer)
		return 0;
	/* A CPU runs one timer at a time, from its detach to its exit: another's
	 * exit finds the slot armed by a detach that was no expiry (a restart,
	 * or a drop with no end seen): disarmed, not left armed forever. */
	if (slot->timer != (__u64)timer && slot->rearmed) {
		slot->timer = 0;
		__sync_fetch_and_add(&request_slots_armed, -1);
		return 0;
	}
	if (slot->timer != (__u64)timer)
		slot->outcome = NETTAP_REQ_KILLED;
	req = slot->req;
	rearmed = slot->rearmed;
	outcome = slot->outcome;
	slot->timer = 0;
	__sync_fetch_and_add(&request_slots_armed, -1);
	if (!rearmed)
		request_end(req, outcome, 0);
	return 0;
}

/* Every timer function of the node returned: no while no slot is armed,
 * here; the rest is request_timer_returned (timer.bpf.h). */
NETTAP_PROG("probe=tcp_request mech=tp_btf records=request")
SEC("tp_btf/timer_expire_exit")
int BPF_PROG(tcp_request_exit, struct timer_list *timer)
{
	if (!request_slots_armed)
		return 0;
	return request_timer_returned(timer);
}

/* ring obs_events: a captured listener's socket made from a SYN cookie (no
 * request socket: made and ended at once). Its peer is the child's, which
 * kernels before Linux 6.x set after this state change (0 then). */
static __always_inline void cookie_made(const struct sock *sk)
{
	struct request e = {};

	e.made_ns = bpf_ktime_get_ns();
	e.wants = target_kinds(sk, false, false);
	obs_sock(sk, false, &e.ports, &e.at.addrs, &e.at.netns);
	obs_count(NETTAP_OBS_REQUESTS + NETTAP_REQ_COOKIE);
	request_record(&e, NETTAP_REQ_COOKIE, 0, 0);
}

/* A listener's state changed (tcp_request_state, past its first compare):
 * a captured listener's own life (its drops counted from its listen to its
 * close), and a captured listener's child born from a SYN cookie
 * (cookie_v4_check or cookie_v6_check on the stack: a child made from a
 * request socket is born in tcp_check_req). */
static __noinline int listener_changed(void *ctx, const struct sock *sk, int newstate)
{
	struct nettap_capture_config *cfg;

	if (BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP)
		return 0;
	if (newstate == TCP_CLOSE_STATE) { /* a listener closed: no filter, its entry says */
		listener_count(sk, true);
		return 0;
	}
	cfg = active_config();
	if (!cfg || !sock_matches(cfg, (struct sock *)sk, false))
		return 0;
	if (newstate == TCP_LISTEN_STATE)
		listener_start(sk);
	else if (newstate == TCP_SYN_RECV_STATE && request_cause(ctx) == NETTAP_REQ_COOKIE &&
		 sample_keep(cfg, (struct sock *)sk, false))
		cookie_made(sk);
	return 0;
}

/* A socket changed state: every change of the node that is no listener's
 * stops at the first compare, here; the rest is listener_changed
 * (timer.bpf.h). */
NETTAP_PROG("probe=tcp_request mech=tp_btf records=request")
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(tcp_request_state, const struct sock *sk, int oldstate, int newstate)
{
	if (oldstate != TCP_LISTEN_STATE && newstate != TCP_LISTEN_STATE)
		return 0;
	return listener_changed(ctx, sk, newstate);
}
