// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * timewait.bpf.c: captured connections' TIME_WAIT sockets, probe
 * tcp_timewait: tp_btf on the timer wheel's tracepoints, which every kernel
 * of the matrix has (function probes are not offered everywhere). A TIME_WAIT
 * socket's life is its tw_timer's (net/ipv4/inet_timewait_sock.c): started
 * as it is made (timer:timer_start; tcp_state ties it to its connection:
 * timewait.bpf.h), detached as it fires (timer:timer_cancel, the wheel's
 * detach_timer, then its function tw_timer_handler kills it), or detached
 * early by inet_twsk_deschedule_put, which kills it: a connect or a SYN
 * taking its tuple, a reset, its network namespace's end. The kernel stack
 * at the detach tells which: the function that called
 * inet_twsk_deschedule_put (addresses from /proc/kallsyms: struct
 * nettap_ksyms). A detach neither due nor a kill is a restart (mod_timer:
 * a FIN or segment into TIME_WAIT), which timer:timer_start follows.
 *
 * The three programs run for every timer of the node: one compare of the
 * timer's function says no for all but TIME_WAIT sockets' timers, and a
 * count for all but those of captured connections.
 */
#include "timewait.bpf.h"

/* The TIME_WAIT socket whose tw_timer timer is (a number: its address). */
static __always_inline __u64 timer_tw(const struct timer_list *timer)
{
	return (__u64)timer - bpf_core_field_offset(struct inet_timewait_sock, tw_timer);
}

/* Frames of the kernel stack read at a detach: the tracepoint's and the
 * timer code's (a handful) before inet_twsk_deschedule_put's. */
#define TW_STACK 16

/* The slot of nettap_ksyms.tw_callers whose function holds ip, or -1. */
static __always_inline int caller_slot(__u64 ip)
{
	const __u64 *c = nettap_ksyms.tw_callers;

	for (int i = 0; i < NETTAP_KSYM_CALLERS; i++)
		if (ip >= c[i * 3] && ip < c[i * 3 + 1])
			return i;
	return -1;
}

/* How a caller of inet_twsk_deschedule_put (or the purge, which may inline
 * it) kills a TIME_WAIT socket; NETTAP_TW_KILLED when it is none of them. */
static __always_inline __u8 caller_cause(__u64 ip, const void *tw)
{
	int i = caller_slot(ip);

	if (i < 0 || i >= NETTAP_KSYM_CALLERS)
		return NETTAP_TW_KILLED;
	if (nettap_ksyms.tw_callers[i * 3 + 2])
		return nettap_ksyms.tw_callers[i * 3 + 2];
	/* tcp_v4_rcv, tcp_v6_rcv: a SYN a TIME_WAIT socket let a listener
	 * take (TCP_TW_SYN), or new data to one half-closed, answered by a
	 * reset (TCP_TW_RST, a FIN_WAIT2 one's) */
	return BPF_CORE_READ((const struct inet_timewait_sock *)tw, tw_substate) == TCP_FIN_WAIT2
		       ? NETTAP_TW_RESET
		       : NETTAP_TW_REUSED;
}

/* Is ip in inet_twsk_deschedule_put (or a clone of it)? */
static __always_inline bool in_deschedule(__u64 ip)
{
	const __u64 *d = nettap_ksyms.tw_deschedule;

	for (int i = 0; i < NETTAP_KSYM_DESCHEDULE; i++)
		if (ip >= d[i * 2] && ip < d[i * 2 + 1])
			return true;
	return false;
}

/* kill_cause: the kernel stack could not be read */
#define TW_NO_STACK 0xff

/* Why a TIME_WAIT socket's timer is detached now, by the kernel stack: a
 * kill's cause, 0 (not a kill: it fires, or starts again), or TW_NO_STACK. */
static __always_inline __u8 kill_cause(void *ctx, const void *tw)
{
	__u64 stack[TW_STACK];
	long n;
	int k;

	n = bpf_get_stack(ctx, stack, sizeof(stack), 0);
	if (n <= 0)
		return TW_NO_STACK;
	n /= sizeof(__u64);
	for (int i = 0; i < TW_STACK; i++) {
		if (i >= n)
			break;
		if (in_deschedule(stack[i]))
			return i + 1 < n && i + 1 < TW_STACK ? caller_cause(stack[i + 1], tw)
							     : NETTAP_TW_KILLED;
		/* inet_twsk_purge, where inet_twsk_deschedule_put is inlined in it */
		k = caller_slot(stack[i]);
		if (k >= 0 && k < NETTAP_KSYM_CALLERS &&
		    nettap_ksyms.tw_callers[k * 3 + 2] == NETTAP_TW_PURGED)
			return NETTAP_TW_PURGED;
	}
	return 0;
}

/* A TIME_WAIT socket's timer started (tcp_timewait, past its first
 * compare): as it is made (tied to its connection where that is captured:
 * timewait_made), or again (a followed one's expiry moves). */
static __noinline int timewait_started(const struct timer_list *timer)
{
	struct timewait *e;
	__u64 tw;

	tw = timer_tw(timer);
	if (timewait_tracked) {
		e = bpf_map_lookup_elem(&timewait_socks, &tw);
		if (e) {
			e->expires = timer->expires;
			return 0;
		}
	}
	if (timewait_pending_n)
		timewait_made(tw, timer->expires);
	return 0;
}

/* Every timer of the node started: no for all but TIME_WAIT sockets',
 * here; the rest is timewait_started (timer.bpf.h). */
NETTAP_PROG("probe=tcp_timewait mech=tp_btf records=timewait")
SEC("tp_btf/timer_start")
int BPF_PROG(tcp_timewait, struct timer_list *timer)
{
	if ((__u64)timer->function != nettap_ksyms.tw_timer_handler)
		return 0;
	return timewait_started(timer);
}

/* A followed TIME_WAIT socket ended: counted, its record, forgotten. A
 * subprogram (timer.bpf.h). */
static __noinline int timewait_end(__u64 tw, __u8 cause, long left)
{
	struct timewait *found, e;

	found = bpf_map_lookup_elem(&timewait_socks, &tw);
	if (!found)
		return 0;
	e = *found;
	if (bpf_map_delete_elem(&timewait_socks, &tw)) /* another CPU's end */
		return 0;
	__sync_fetch_and_add(&timewait_tracked, -1);
	obs_count(NETTAP_OBS_TIMEWAIT + cause);
	timewait_record((const void *)tw, &e, cause, left > 0 ? left : 0,
			(bpf_ktime_get_ns() - e.made_ns) / 1000000);
	return 0;
}

/* A TIME_WAIT socket's timer detached (tcp_timewait_end, past its first
 * compare): a followed one killed early (kill_cause). A detach that is no
 * kill is the wheel's as it fires it (tcp_timewait_expire follows) or a
 * restart (timer_start follows). */
static __noinline int timewait_detached(void *ctx, const struct timer_list *timer)
{
	__u64 tw;
	long left;
	__u8 cause;

	tw = timer_tw(timer);
	if (!bpf_map_lookup_elem(&timewait_socks, &tw))
		return 0;
	left = (long)(timer->expires - bpf_jiffies64());
	cause = kill_cause(ctx, (const void *)tw);
	/* unread: an end all the same where time is left (a restart taken for
	 * one would leave it followed for ever); its expiry is the wheel's */
	if (cause == TW_NO_STACK)
		cause = left > 0 ? NETTAP_TW_KILLED : 0;
	if (cause)
		timewait_end(tw, cause, left);
	return 0;
}

/* Every timer of the node detached: the first compare says no for all but
 * followed TIME_WAIT sockets', here (the count first: no timer's memory read
 * while none is followed); the rest is timewait_detached (timer.bpf.h). */
NETTAP_PROG("probe=tcp_timewait mech=tp_btf records=timewait")
SEC("tp_btf/timer_cancel")
int BPF_PROG(tcp_timewait_end, struct timer_list *timer)
{
	if (!timewait_tracked || (__u64)timer->function != nettap_ksyms.tw_timer_handler)
		return 0;
	return timewait_detached(ctx, timer);
}

/* The wheel runs a TIME_WAIT socket's timer function: a followed one
 * expired (tw_timer_handler kills it now). */
NETTAP_PROG("probe=tcp_timewait mech=tp_btf records=timewait")
SEC("tp_btf/timer_expire_entry")
int BPF_PROG(tcp_timewait_expire, struct timer_list *timer)
{
	if (!timewait_tracked || (__u64)timer->function != nettap_ksyms.tw_timer_handler)
		return 0;
	return timewait_end(timer_tw(timer), NETTAP_TW_EXPIRED, 0);
}
