/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * timewait.bpf.h: captured connections' TIME_WAIT sockets, shared by the
 * timer programs of bpf/timewait.bpf.c and tcp_state (lifecycle.bpf.c),
 * which ties a TIME_WAIT socket to the connection whose socket it replaces.
 *
 * A connection closing through TIME_WAIT never passes TIME_WAIT in its own
 * socket's states: tcp_time_wait (net/ipv4/tcp_minisocks.c) makes an
 * inet_timewait_sock with its tuple, starts the new socket's tw_timer
 * (inet_twsk_schedule, or inet_twsk_hashdance_schedule since Linux 6.10:
 * timer:timer_start, function tw_timer_handler), then tcp_done moves the old
 * socket from FIN_WAIT2 or CLOSING to CLOSE (sock:inet_sock_set_state). A
 * captured socket entering FIN_WAIT2 or CLOSING, the two states it can
 * leave by tcp_time_wait, leaves its tuple (its network namespace, ports and
 * addresses: unique in the namespace's established hash, which the TIME_WAIT
 * socket takes over) in timewait_pending; the timer's start of a TIME_WAIT
 * socket of that tuple ties it to the connection there and then, whatever
 * the CPU or what ran between. The socket's CLOSE forgets its entry, and
 * counts a TIME_WAIT socket not tied (NETTAP_OBS_TIMEWAIT + TW_UNTIED) where
 * its entry is still there though the socket is no longer hashed
 * (inet_twsk_hashdance put a TIME_WAIT socket in its place; a reset's
 * CLOSE unhashes it after): only an insert refused leaves one.
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

/* A socket's or TIME_WAIT socket's tuple: its network namespace (the
 * struct net's address), family, ports and addresses; padding zeroed. */
struct timewait_tuple {
	__u64 net;
	struct nettap_ports ports;
	__u16 pad;
	struct nettap_addrs addrs;
};

/* A captured connection's TIME_WAIT socket, by its address, from its making
 * to its end. */
struct timewait {
	__u64 conn_id;
	__u64 made_ns;
	__u64 expires; /* jiffies: when its timer fires */
	__u32 pid;
	__u32 wants; /* the connection's conn.wants */
};

/* A captured connection in FIN_WAIT2 or CLOSING, by its tuple: what its
 * TIME_WAIT socket's entry will carry (made_ns and expires unset). Sized
 * as the established sockets that close at once; an insert refused is
 * counted (map_insert_failures, NETTAP_MAP_TIMEWAIT) and, at its CLOSE, as
 * a TIME_WAIT socket not tied. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 16384);
	__type(key, struct timewait_tuple);
	__type(value, struct timewait);
} timewait_pending NETTAP_MAP("prealloc_max=1024") SEC(".maps");

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

/* Entries of timewait_socks, and of timewait_pending: the timer programs,
 * which run for every timer of the node, look no further while they are 0
 * (one cache line for both). User space zeroes timewait_tracked as it
 * empties timewait_socks, its programs detached (a store to it alone,
 * through the map's memory: exporter/kernel/followed.py). */
NETTAP_SHARED __u32 timewait_tracked SEC(".bss.timers");
NETTAP_SHARED __u32 timewait_pending_n SEC(".bss.timers");

/* The kernel functions the timer programs compare with (struct
 * nettap_ksyms), written by user space before it attaches them. */
NETTAP_SHARED struct nettap_ksyms nettap_ksyms SEC(".data.ksyms");

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

/* A socket's or TIME_WAIT socket's tuple (sock_common: both). */
static __always_inline void timewait_tuple_of(const void *sk, struct timewait_tuple *t)
{
	__builtin_memset(t, 0, sizeof(*t));
	t->net = (__u64)BPF_CORE_READ((const struct sock_common *)sk, skc_net.net);
	read_addrs((struct sock *)sk, false, &t->ports, &t->addrs);
}

/* tcp_state: a captured socket's state change. Entering FIN_WAIT2 or
 * CLOSING (while the timer programs are attached: nettap_ksyms says), its
 * tuple is left for the TIME_WAIT socket that may replace it; leaving them,
 * it is forgotten, and a TIME_WAIT socket that replaced it (the socket no
 * longer hashed) with the entry still there is counted, not tied. */
static __always_inline void timewait_pending_state(const struct sock *sk, const struct conn *cn,
						   int oldstate, int newstate)
{
	struct timewait_tuple t;
	struct timewait e = {};

	if (newstate == TCP_FIN_WAIT2 || newstate == TCP_CLOSING) {
		if (!nettap_ksyms.tw_timer_handler)
			return;
		timewait_tuple_of(sk, &t);
		e.conn_id = cn->id;
		e.pid = cn->pid;
		e.wants = cn->wants;
		/* refused: the map full (an entry of this tuple already there is
		 * another life's of this socket, not yet forgotten: kept) */
		if (bpf_map_update_elem(&timewait_pending, &t, &e, BPF_NOEXIST)) {
			if (!bpf_map_lookup_elem(&timewait_pending, &t))
				count_insert_failure(NETTAP_MAP_TIMEWAIT);
			return;
		}
		__sync_fetch_and_add(&timewait_pending_n, 1);
		return;
	}
	if ((oldstate != TCP_FIN_WAIT2 && oldstate != TCP_CLOSING) || !timewait_pending_n)
		return;
	timewait_tuple_of(sk, &t);
	/* none: tied (its TIME_WAIT socket took it), or never left */
	if (bpf_map_delete_elem(&timewait_pending, &t))
		return;
	__sync_fetch_and_add(&timewait_pending_n, -1);
	/* the timer programs attached, and the socket replaced by a TIME_WAIT
	 * socket: one not tied */
	if (newstate == TCP_CLOSE && nettap_ksyms.tw_timer_handler &&
	    !BPF_CORE_READ(sk, __sk_common.skc_nulls_node.pprev))
		obs_count(NETTAP_OBS_TIMEWAIT + TW_UNTIED);
}

/* tcp_timewait: a TIME_WAIT socket's timer started for the first time:
 * where its tuple is a captured connection's (timewait_pending), it is that
 * connection's from now on: followed, counted and its made record published. */
static __always_inline void timewait_made(__u64 tw, __u64 expires)
{
	struct timewait_tuple t;
	struct timewait *found, e;
	long left;

	timewait_tuple_of((const void *)tw, &t);
	found = bpf_map_lookup_elem(&timewait_pending, &t);
	if (!found)
		return;
	e = *found;
	if (bpf_map_delete_elem(&timewait_pending, &t)) /* another CPU's */
		return;
	__sync_fetch_and_add(&timewait_pending_n, -1);
	e.made_ns = bpf_ktime_get_ns();
	e.expires = expires;
	if (bpf_map_update_elem(&timewait_socks, &tw, &e, BPF_NOEXIST)) {
		count_insert_failure(NETTAP_MAP_TIMEWAIT);
		obs_count(NETTAP_OBS_TIMEWAIT + TW_UNTIED);
		return;
	}
	__sync_fetch_and_add(&timewait_tracked, 1);
	obs_count(NETTAP_OBS_TIMEWAIT + NETTAP_TW_MADE);
	left = (long)(expires - bpf_jiffies64());
	timewait_record((const void *)tw, &e, NETTAP_TW_MADE, left > 0 ? left : 0, 0);
}

#endif /* NETTAP_TIMEWAIT_BPF_H */
