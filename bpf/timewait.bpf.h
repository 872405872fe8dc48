/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * timewait.bpf.h: captured connections' TIME_WAIT sockets, shared by the
 * timer programs of bpf/timewait.bpf.c and tcp_state (lifecycle.bpf.c),
 * which ties a TIME_WAIT socket to the connection whose socket it replaces.
 *
 * A connection closing through TIME_WAIT never passes TIME_WAIT in its own
 * socket's states: tcp_time_wait (net/ipv4/tcp_minisocks.c) makes an
 * inet_timewait_sock with its tuple, starts the new socket's tw_timer
 * (inet_twsk_schedule, or inet_twsk_hashdance_schedule since Linux 6.10: timer:timer_start,
 * function tw_timer_handler), then tcp_done moves the old socket from
 * FIN_WAIT2 or CLOSING to CLOSE (sock:inet_sock_set_state), on the same CPU.
 * So timer_start keeps the TIME_WAIT socket it saw start in this CPU's slot,
 * and tcp_state, at that CLOSE of a captured socket, takes it from there
 * when its tuple is the socket's. Bottom halves are not off throughout:
 * tcp_time_wait calls local_bh_enable() between the two, so a softirq there
 * may start another timer and take the slot. That socket is then not
 * followed, but counted: a CLOSE from FIN_WAIT2 or CLOSING of a socket no
 * longer hashed (inet_twsk_hashdance put its TIME_WAIT socket in its place;
 * a reset's CLOSE unhashes it after) that finds no slot of its tuple
 * (NETTAP_OBS_TIMEWAIT + TW_UNTIED).
 */
#ifndef NETTAP_TIMEWAIT_BPF_H
#define NETTAP_TIMEWAIT_BPF_H

#include "obs.bpf.h"
#include "timer.bpf.h"

#define TCP_FIN_WAIT2 5
#define TCP_TIME_WAIT 6
#define TCP_CLOSING   11

/* obs_counters row NETTAP_OBS_TIMEWAIT + this (no NETTAP_TW_* is 0): a
 * captured connection's TIME_WAIT socket not tied to it, so not followed */
#define TW_UNTIED 0

/* The TIME_WAIT socket whose timer this CPU started last: its address
 * (0: none), its expiry and when. */
struct timewait_slot {
	__u64 tw;
	__u64 expires;
	__u64 ts_ns;
};

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct timewait_slot);
} timewait_slot SEC(".maps");

/* A captured connection's TIME_WAIT socket, by its address, from its making
 * to its end. */
struct timewait {
	__u64 conn_id;
	__u64 made_ns;
	__u64 expires; /* jiffies: when its timer fires */
	__u32 pid;
	__u32 wants; /* the connection's conn.wants */
};

/* Sized for 32,768 at once: 60 s of TIME_WAIT at 546 captured connections
 * closed a second (an end closing first keeps one); an insert refused is
 * counted (map_insert_failures, NETTAP_MAP_TIMEWAIT). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 32768);
	__type(key, __u64);
	__type(value, struct timewait);
} timewait_socks NETTAP_MAP("prealloc_max=4096") SEC(".maps");

/* Entries of timewait_socks: the timer programs, which run for every timer
 * of the node, look no further while it is 0. */
NETTAP_SHARED __u32 timewait_tracked SEC(".bss.timers");

/* The kernel functions the timer programs compare with (struct
 * nettap_ksyms), written by user space before it attaches them. */
NETTAP_SHARED struct nettap_ksyms nettap_ksyms SEC(".data.ksyms");

/* At most this long from a TIME_WAIT socket's timer start to its old
 * socket's CLOSE: both are one call of tcp_time_wait's; a slot older than
 * this is another's, left by a socket not captured. */
#define TIMEWAIT_TIE_NS 50000000ULL

static __always_inline struct timewait_slot *timewait_slot_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&timewait_slot, &zero);
}

/* ring obs_events: a TIME_WAIT socket made or ended. */
static __always_inline void timewait_record(const struct sock_common *tw, const struct timewait *e,
					    __u8 event, __u32 timeout, __u32 age_ms)
{
	struct nettap_capture_config *cfg;
	struct nettap_timewait *r;
	__u32 zero = 0;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	if (e->wants ? !(e->wants & (1U << NETTAP_KIND_TIMEWAIT))
		     : !kind_wanted(cfg, NETTAP_KIND_TIMEWAIT))
		return;
	r = bpf_ringbuf_reserve(&obs_events, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_OBS_EVENTS, 1);
		return;
	}
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = e->conn_id;
	r->h.kind = NETTAP_KIND_TIMEWAIT;
	r->h.pid = e->pid;
	r->timeout_jiffies = timeout;
	r->age_ms = age_ms;
	r->event = event;
	r->substate = BPF_CORE_READ((const struct inet_timewait_sock *)tw, tw_substate);
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	OBS_SOCK(r, tw, false);
	obs_submit(r);
}

/* Do a TIME_WAIT socket and a socket have one tuple (netns, family, ports,
 * addresses)? */
static __always_inline bool same_tuple(const struct sock *sk, const struct sock_common *tw)
{
	struct nettap_ports p1, p2;
	struct nettap_addrs a1, a2;

	if (BPF_CORE_READ(sk, __sk_common.skc_net.net) != BPF_CORE_READ(tw, skc_net.net))
		return false;
	read_addrs((struct sock *)sk, false, &p1, &a1);
	read_addrs((struct sock *)tw, false, &p2, &a2);
	if (p1.family != p2.family || p1.sport != p2.sport || p1.dport != p2.dport)
		return false;
	for (int i = 0; i < 8; i++)
		if (((__u32 *)&a1)[i] != ((__u32 *)&a2)[i])
			return false;
	return true;
}

/* tcp_state: a captured socket moved from FIN_WAIT2 or CLOSING to CLOSE.
 * Where tcp_time_wait made a TIME_WAIT socket for it just before (this
 * CPU's slot, its tuple), that socket is the connection's from now on:
 * followed, counted and its made record published. */
static __always_inline void timewait_made(const struct sock *sk, const struct conn *cn,
					  int oldstate)
{
	struct timewait_slot *slot;
	struct timewait e = {};
	__u64 tw, now;
	long left;

	if (oldstate != TCP_FIN_WAIT2 && oldstate != TCP_CLOSING)
		return;
	slot = timewait_slot_get();
	if (!slot)
		return;
	tw = slot->tw;
	now = bpf_ktime_get_ns();
	slot->tw = 0;
	if (!tw || now - slot->ts_ns > TIMEWAIT_TIE_NS || !same_tuple(sk, (const void *)tw)) {
		/* the timer programs attached (nettap_ksyms written first), and
		 * the socket replaced by a TIME_WAIT socket: one not tied */
		if (nettap_ksyms.tw_timer_handler &&
		    !BPF_CORE_READ(sk, __sk_common.skc_nulls_node.pprev))
			obs_count(NETTAP_OBS_TIMEWAIT + TW_UNTIED);
		return;
	}
	e.conn_id = cn->id;
	e.made_ns = now;
	e.expires = slot->expires;
	e.pid = cn->pid;
	e.wants = cn->wants;
	if (bpf_map_update_elem(&timewait_socks, &tw, &e, BPF_NOEXIST)) {
		count_insert_failure(NETTAP_MAP_TIMEWAIT);
		return;
	}
	__sync_fetch_and_add(&timewait_tracked, 1);
	obs_count(NETTAP_OBS_TIMEWAIT + NETTAP_TW_MADE);
	left = (long)(e.expires - bpf_jiffies64());
	timewait_record((const void *)tw, &e, NETTAP_TW_MADE, left > 0 ? left : 0, 0);
}

#endif /* NETTAP_TIMEWAIT_BPF_H */
