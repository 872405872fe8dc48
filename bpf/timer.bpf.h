/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * timer.bpf.h: a captured socket's retransmit and keepalive timers as the
 * timer wheel fires them (timer:timer_expire_entry): how far behind its
 * slot the CPU ran the wheel, the wheel's rounding, and whether the owner
 * held the socket. Records on obs_events; behind_jiffies counted in the
 * obs_counters rows NETTAP_OBS_TIMERS + timer * 16 + i: i of 0..9 a
 * histogram bucket (behind_bucket), 15 their sum. And the probes those
 * timers send (timer:timer_expire_exit): probe records, counted in the rows
 * NETTAP_OBS_WAKEUPS + NETTAP_WAKEUP_*.
 */
#ifndef NETTAP_TIMER_BPF_H
#define NETTAP_TIMER_BPF_H

#include <bpf/bpf_tracing.h>
#include "obs.bpf.h"

/* The socket a timer_list is a member of: the timer's address less the
 * member's offset (CO-RE). A BTF pointer less a constant stays one. */
#define TIMER_OWNER(timer, type, member) \
	((const struct sock *)((void *)(timer)-bpf_core_field_offset(type, member)))

/* The captured socket's timer this CPU's wheel is running, kept by
 * tcp_timer for tcp_timer_exit: the timer (its address, a number), its
 * socket, which timer and icsk_probes_out before it ran. Timers of one CPU
 * run one after the other (in its softirq, or its softirq thread on
 * PREEMPT_RT). timer 0: none. */
struct nettap_timer_slot {
	__u64 timer;
	__u64 sk;
	__u8 which;
	__u8 probes_out;
	__u8 pad[6];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_timer_slot);
} timer_slot SEC(".maps");

/* CPUs whose slot holds a timer: tcp_timer_exit, which runs after every
 * timer of the node, reads this and nothing else while it is 0. */
__u32 timer_slots_armed SEC(".bss.timers");

static __always_inline struct nettap_timer_slot *timer_slot_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&timer_slot, &zero);
}

/* Empty the slot (a destroyed socket's, whose memory its timer's sock_put
 * may free before the timer returns). */
static __always_inline void timer_slot_clear(struct nettap_timer_slot *slot)
{
	slot->timer = 0;
	slot->sk = 0;
	__sync_fetch_and_add(&timer_slots_armed, -1);
}

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
 * captured socket. The keepalive timer is sk_timer or, on kernels that have
 * it (Debian's 6.1 and 6.12), icsk_keepalive_timer: keepalive_timer_offset(). */
NETTAP_PROG("probe=tcp_timer mech=tp_btf")
SEC("tp_btf/timer_expire_entry")
int BPF_PROG(tcp_timer, struct timer_list *timer, unsigned long baseclk)
{
	struct nettap_timer_slot *slot;
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
		/* sk_timer, or icsk_keepalive_timer (core_fixes.bpf.h) */
		sk = (const struct sock *)((void *)timer - keepalive_timer_offset());
		cn = captured_conn(sk);
	}
	if (!cn)
		return 0;
	now = bpf_jiffies64();
	behind = now > baseclk ? now - baseclk : 0;
	obs_count(NETTAP_OBS_TIMERS + which * 16 + behind_bucket(behind));
	obs_add(NETTAP_OBS_TIMERS + which * 16 + 15, behind);
	if (which == NETTAP_TIMER_RETRANSMIT)
		event = BPF_CORE_READ((const struct inet_connection_sock *)sk, icsk_pending);
	slot = timer_slot_get();
	if (slot && (which == NETTAP_TIMER_KEEPALIVE || event == NETTAP_EVENT_PROBE0)) {
		if (!slot->timer)
			__sync_fetch_and_add(&timer_slots_armed, 1);
		slot->timer = (__u64)timer;
		slot->sk = (__u64)sk;
		slot->which = which;
		slot->probes_out =
			BPF_CORE_READ((const struct inet_connection_sock *)sk, icsk_probes_out);
	}
	r = obs_reserve(sizeof(*r), NETTAP_KIND_TIMER, cn);
	if (!r)
		return 0;
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

/* A captured socket's timer returns: a probe record when it sent one (its
 * icsk_probes_out grew: tcp_send_probe0 and tcp_keepalive_timer count each
 * probe tcp_write_wakeup sends there). The socket is alive: a socket
 * destroyed while its timer ran emptied the slot (tcp_destroy). */
NETTAP_PROG("probe=tcp_timer_exit mech=tp_btf")
SEC("tp_btf/timer_expire_exit")
int BPF_PROG(tcp_timer_exit, struct timer_list *timer)
{
	const struct inet_connection_sock *icsk;
	struct nettap_timer_slot *slot;
	struct nettap_probe *r;
	struct conn *cn;
	__u8 out, which;
	__u64 key;

	if (!timer_slots_armed)
		return 0;
	slot = timer_slot_get();
	if (!slot || !slot->timer || slot->timer != (__u64)timer)
		return 0;
	icsk = (const struct inet_connection_sock *)slot->sk;
	which = slot->which;
	out = BPF_CORE_READ(icsk, icsk_probes_out);
	if (out <= slot->probes_out) {
		timer_slot_clear(slot);
		return 0;
	}
	key = slot->sk;
	timer_slot_clear(slot);
	cn = bpf_map_lookup_elem(&capture_conns, &key);
	if (!cn)
		return 0;
	which = which == NETTAP_TIMER_KEEPALIVE ? NETTAP_WAKEUP_KEEPALIVE : NETTAP_WAKEUP_WINDOW;
	obs_count(NETTAP_OBS_WAKEUPS + which);
	r = obs_reserve(sizeof(*r), NETTAP_KIND_PROBE, cn);
	if (!r)
		return 0;
	r->snd_wnd = BPF_CORE_READ((const struct tcp_sock *)icsk, snd_wnd);
	r->rto_jiffies = BPF_CORE_READ(icsk, icsk_rto);
	r->probe = which;
	r->probes_out = out;
	r->state = BPF_CORE_READ((const struct sock *)icsk, __sk_common.skc_state);
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	OBS_SOCK(r, icsk, false);
	obs_submit(r);
	return 0;
}

#endif /* NETTAP_TIMER_BPF_H */
