/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * timer.bpf.h: a captured socket's retransmit and keepalive timers as the
 * timer wheel fires them (timer:timer_expire_entry): how far behind its
 * slot the CPU ran the wheel, the wheel's rounding, and whether the owner
 * held the socket. Records on obs_events; behind_jiffies counted in the
 * obs_counters rows NETTAP_OBS_TIMERS + timer * 16 + i: i of 0..9 a
 * histogram bucket (behind_bucket), 15 their sum.
 */
#ifndef NETTAP_TIMER_BPF_H
#define NETTAP_TIMER_BPF_H

#include <bpf/bpf_tracing.h>
#include "obs.bpf.h"

/* The socket a timer_list is a member of: the timer's address less the
 * member's offset (CO-RE). A BTF pointer less a constant stays one. */
#define TIMER_OWNER(timer, type, member) \
	((const struct sock *)((void *)(timer)-bpf_core_field_offset(type, member)))

/* log2 bucket of a jiffies count: 0 for 0, b for [2^(b-1), 2^b), 9 above 255. */
static __always_inline __u32 behind_bucket(__u64 n)
{
	__u32 b = 0;

	for (int i = 0; i < 9; i++)
		b += n >= (1ULL << i);
	return b;
}

/* The wheel fires timer, whose slot was at baseclk (the wheel's clock as it
 * expired the timer's bucket, kernel/time/timer.c: expire_timers). Timers
 * of every kind pass here; a captured socket's are told by their address:
 * the socket the timer would be the keepalive or retransmit timer of is in
 * the connection table (its group and slot, array reads, say no for nearly
 * every other timer before any hash lookup). No address but a socket's own timer's gives a
 * captured socket. (Compared with /proc/kallsyms' tcp_keepalive_timer, the
 * function of the keepalive fired on Linux 6.1-6.12 of the test matrix did
 * not match.) */
SEC("tp_btf/timer_expire_entry")
int BPF_PROG(tcp_timer, struct timer_list *timer, unsigned long baseclk)
{
	const struct sock *sk;
	struct nettap_timer *r;
	struct conn *cn;
	__u64 now, behind;
	__u8 which, event = 0;

	which = NETTAP_TIMER_RETRANSMIT;
	sk = TIMER_OWNER(timer, struct inet_connection_sock, icsk_retransmit_timer);
	cn = captured_conn(sk);
	if (!cn) {
		which = NETTAP_TIMER_KEEPALIVE;
		sk = TIMER_OWNER(timer, struct sock, sk_timer);
		cn = captured_conn(sk);
	}
	if (!cn)
		return 0;
	now = bpf_jiffies64();
	behind = now > baseclk ? now - baseclk : 0;
	obs_count(NETTAP_OBS_TIMERS + which * 16 + behind_bucket(behind));
	obs_add(NETTAP_OBS_TIMERS + which * 16 + 15, behind);
	r = obs_reserve(sizeof(*r), NETTAP_KIND_TIMER, cn);
	if (!r)
		return 0;
	if (which == NETTAP_TIMER_RETRANSMIT)
		event = BPF_CORE_READ((const struct inet_connection_sock *)sk, icsk_pending);
	r->behind_jiffies = behind;
	r->late_jiffies = baseclk > timer->expires ? baseclk - timer->expires : 0;
	r->timer = which;
	r->event = event;
	r->owned = BPF_CORE_READ(sk, sk_lock.owned) != 0;
	r->state = BPF_CORE_READ(sk, __sk_common.skc_state);
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	OBS_SOCK(r, sk, false);
	obs_submit(r);
	return 0;
}

#endif /* NETTAP_TIMER_BPF_H */
