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
 * Both programs run for every timer of the node: one compare of the
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

/* How a caller of inet_twsk_deschedule_put (or the purge, which may inline
 * it) kills a TIME_WAIT socket; NETTAP_TW_KILLED when it is none of them. */
static __always_inline __u8 caller_cause(__u64 ip, const void *tw)
{
	const __u64 *c = nettap_ksyms.tw_callers;

	for (int i = 0; i < NETTAP_KSYM_CALLERS; i++) {
		if (ip < c[i * 3] || ip >= c[i * 3 + 1])
			continue;
		if (c[i * 3 + 2])
			return c[i * 3 + 2];
		/* tcp_v4_rcv, tcp_v6_rcv: a SYN a TIME_WAIT socket let a listener
		 * take (TCP_TW_SYN), or new data to one half-closed, answered
		 * by a reset (TCP_TW_RST, a FIN_WAIT2 one's) */
		return BPF_CORE_READ((const struct inet_timewait_sock *)tw, tw_substate) ==
				       TCP_FIN_WAIT2
			       ? NETTAP_TW_RESET
			       : NETTAP_TW_REUSED;
	}
	return NETTAP_TW_KILLED;
}

/* kill_cause: the kernel stack could not be read */
#define TW_NO_STACK 0xff

/* Why a TIME_WAIT socket's timer is detached now, by the kernel stack: a
 * kill's cause, 0 (not a kill: it fires, or starts again), or TW_NO_STACK. */
static __always_inline __u8 kill_cause(void *ctx, const void *tw)
{
	__u64 stack[TW_STACK];
	const __u64 *d = nettap_ksyms.tw_deschedule;
	long n;

	n = bpf_get_stack(ctx, stack, sizeof(stack), 0);
	if (n <= 0)
		return TW_NO_STACK;
	n /= sizeof(__u64);
	for (int i = 0; i < TW_STACK; i++) {
		if (i >= n)
			break;
		if (stack[i] >= d[0] && stack[i] < d[1])
			return i + 1 < n && i + 1 < TW_STACK ? caller_cause(stack[i + 1], tw)
							     : NETTAP_TW_KILLED;
		/* inet_twsk_purge, where inet_twsk_deschedule_put is inlined in it */
		if (stack[i] >= nettap_ksyms.tw_callers[(NETTAP_KSYM_CALLERS - 1) * 3] &&
		    stack[i] < nettap_ksyms.tw_callers[(NETTAP_KSYM_CALLERS - 1) * 3 + 1])
			return NETTAP_TW_PURGED;
	}
	return 0;
}

/* A TIME_WAIT socket's timer started: as it is made (kept in this CPU's
 * slot for tcp_state), or again (a followed one's expiry moves). */
NETTAP_PROG("probe=tcp_timewait mech=tp_btf records=timewait")
SEC("tp_btf/timer_start")
int BPF_PROG(tcp_timewait, struct timer_list *timer)
{
	struct timewait_slot *slot;
	struct timewait *e;
	__u64 tw;

	if ((__u64)timer->function != nettap_ksyms.tw_timer_handler)
		return 0;
	tw = timer_tw(timer);
	if (timewait_tracked) {
		e = bpf_map_lookup_elem(&timewait_socks, &tw);
		if (e) {
			e->expires = timer->expires;
			return 0;
		}
	}
	slot = timewait_slot_get();
	if (!slot)
		return 0;
	slot->tw = tw;
	slot->expires = timer->expires;
	slot->ts_ns = bpf_ktime_get_ns();
	return 0;
}

/* A TIME_WAIT socket's timer detached: a followed one's end, as it fires
 * (its expiry come) or as it is killed early (kill_cause). */
NETTAP_PROG("probe=tcp_timewait mech=tp_btf records=timewait")
SEC("tp_btf/timer_cancel")
int BPF_PROG(tcp_timewait_end, struct timer_list *timer)
{
	struct timewait *found, e;
	__u64 tw, now_ns;
	long left;
	__u8 cause;

	if ((__u64)timer->function != nettap_ksyms.tw_timer_handler || !timewait_tracked)
		return 0;
	tw = timer_tw(timer);
	found = bpf_map_lookup_elem(&timewait_socks, &tw);
	if (!found)
		return 0;
	left = (long)(timer->expires - bpf_jiffies64());
	cause = kill_cause(ctx, (const void *)tw);
	/* unread: an end all the same (a restart taken for one would leave it
	 * followed for ever), killed while its time is left */
	if (cause == TW_NO_STACK)
		cause = left > 0 ? NETTAP_TW_KILLED : NETTAP_TW_EXPIRED;
	if (!cause) {
		if (left > 0) /* started again: timer_start follows */
			return 0;
		cause = NETTAP_TW_EXPIRED;
	}
	e = *found;
	if (bpf_map_delete_elem(&timewait_socks, &tw)) /* another CPU's end */
		return 0;
	__sync_fetch_and_add(&timewait_tracked, -1);
	obs_count(NETTAP_OBS_TIMEWAIT + cause);
	now_ns = bpf_ktime_get_ns();
	timewait_record((const void *)tw, &e, cause, left > 0 ? left : 0,
			(now_ns - e.made_ns) / 1000000);
	return 0;
}
