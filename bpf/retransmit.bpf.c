// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * retransmit.bpf.c: what TCP sends again and when its timers fire, probes
 * of their own (tp_btf): tcp_retransmit, tcp_synack_retransmit, tcp_timer,
 * tcp_timer_exit, and tcp_segment, the segments captured sockets receive.
 */
#include "filter.bpf.h"
#include <bpf/bpf_tracing.h>
#include "obs.bpf.h"
#include "timer.bpf.h"

/*
 * Segments sent again. A captured socket's retransmissions
 * (tcp:tcp_retransmit_skb), each with the recovery that sent it, and the
 * SYN-ACKs a listener of a captured port sends again
 * (tcp:tcp_retransmit_synack): records on obs_events, counts in the
 * obs_counters rows NETTAP_OBS_RETRANS + NETTAP_RETRANS_*.
 */

/* include/net/inet_connection_sock.h: what the retransmit timer is armed
 * for (icsk_pending); these values have not changed since Linux 4.10. */
#define ICSK_TIME_LOSS_PROBE 5

/* Linux 6.17 gave tcp:tcp_retransmit_skb the transmission's error and fires
 * it for a retransmission that failed too (its classic tracepoint's entry
 * got the field with it). */
struct trace_event_raw_tcp_retransmit_skb___err {
	int err;
} __attribute__((preserve_access_index));

/* include/net/tcp.h: enum tcp_ca_state (congestion control states) */
#define TCP_CA_RECOVERY 3

/* Which recovery sends: tcp_write_timer_handler (net/ipv4/tcp_timer.c)
 * clears icsk_pending before tcp_retransmit_timer sends again (an RTO, the
 * only retransmissions tcp_retries2 counts), and leaves it
 * ICSK_TIME_LOSS_PROBE, its time come, while tcp_send_loss_probe sends a
 * probe, in the Open state (a probe is armed only there). Loss recovery on
 * ACKs (fast retransmit, SACK, RACK and its reordering timer) enters
 * Recovery (or stays in Loss after an RTO) before it sends: the timer's
 * state alone cannot tell it from a probe, since a loss probe is armed after
 * every new send and its time may have come when the ACKs arrive (seen in
 * the emulated guests). */
static __always_inline __u8 retrans_cause(const struct inet_connection_sock *icsk)
{
	__u8 pending = BPF_CORE_READ(icsk, icsk_pending);
	unsigned long expires;

	if (!pending)
		return NETTAP_RETRANS_RTO;
	if (pending != ICSK_TIME_LOSS_PROBE ||
	    BPF_CORE_READ_BITFIELD_PROBED(icsk, icsk_ca_state) >= TCP_CA_RECOVERY)
		return NETTAP_RETRANS_FAST;
	expires = BPF_CORE_READ(icsk, icsk_retransmit_timer.expires);
	return (long)(bpf_jiffies64() - expires) >= 0 ? NETTAP_RETRANS_TLP : NETTAP_RETRANS_FAST;
}

/* ring obs_events: a captured socket sent a segment again. Its fields are
 * read with bpf_probe_read_kernel: a BTF pointer to struct sock does not
 * reach the tcp_sock members past it. */
NETTAP_PROG("probe=tcp_retransmit mech=tp_btf records=retransmit")
SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(tcp_retransmit, const struct sock *sk)
{
	const struct inet_connection_sock *icsk = (const void *)sk;
	const struct tcp_sock *tp = (const void *)sk;
	struct nettap_retransmit *r;
	struct conn *cn;
	__u8 cause;

	cn = captured_conn(sk);
	if (!cn)
		return 0;
	if (bpf_core_field_exists(struct trace_event_raw_tcp_retransmit_skb___err, err) &&
	    (int)ctx[2]) /* it failed: nothing was sent */
		return 0;
	cause = retrans_cause(icsk);
	obs_count(NETTAP_OBS_RETRANS + cause);
	r = obs_reserve(sizeof(*r), NETTAP_KIND_RETRANSMIT, cn);
	if (!r)
		return 0;
	r->rto_jiffies = BPF_CORE_READ(icsk, icsk_rto);
	r->srtt_us = BPF_CORE_READ(tp, srtt_us) >> 3;
	r->cause = cause;
	r->state = BPF_CORE_READ(sk, __sk_common.skc_state);
	r->retransmits = BPF_CORE_READ(icsk, icsk_retransmits);
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	OBS_SOCK(r, sk, false);
	obs_submit(r);
	return 0;
}

/* ring obs_events: a listener sent a SYN-ACK again. The request, not yet a
 * socket, is in no connection table: the socket targets decide (a passive
 * open's rule, state_decide in lifecycle.bpf.c), on the request's own ports and
 * namespace; the header's conn_id and pid are 0. A request starts with the
 * same struct sock_common as a socket, so the socket readers read it. */
NETTAP_PROG("probe=tcp_synack_retransmit mech=tp_btf records=synack_retransmit")
SEC("tp_btf/tcp_retransmit_synack")
int BPF_PROG(tcp_synack_retransmit, const struct sock *sk, const struct request_sock *req)
{
	struct nettap_capture_config *cfg = active_config();
	struct nettap_synack_retransmit *r;
	struct nettap_hdr *h;

	if (!cfg || !sock_matches(cfg, (struct sock *)req, false) ||
	    !sample_keep(cfg, (struct sock *)req, false))
		return 0;
	obs_count(NETTAP_OBS_RETRANS + NETTAP_RETRANS_SYNACK);
	if (!kind_wanted(cfg, NETTAP_KIND_SYNACK_RETRANSMIT))
		return 0;
	r = bpf_ringbuf_reserve(&obs_events, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_OBS_EVENTS, 1);
		return 0;
	}
	h = &r->h;
	h->ts_ns = bpf_ktime_get_ns();
	h->conn_id = 0;
	h->kind = NETTAP_KIND_SYNACK_RETRANSMIT;
	h->pid = 0;
	r->retransmits = BPF_CORE_READ(req, num_retrans);
	r->pad0 = 0;
	__builtin_memset(r->pad1, 0, sizeof(r->pad1));
	OBS_SOCK(r, req, false);
	obs_submit(r);
	return 0;
}

/*
 * The segments an established captured socket receives
 * (tcp:tcp_probe, at the top of tcp_rcv_established), for the sockets of a
 * target that asks for segments (conn.wants, decided in the socket's owner's
 * task: publish_owner, or at a passive open by the socket targets). A high
 * rate: records on a ring of their own, segments, so that a flood of them
 * costs no lifecycle record its room on obs_events.
 */

/* A CPU looks at the ring's fill once it has published this much since its
 * last look; the reader is woken at a quarter of the ring pending. */
#define SEGMENT_CHECK_BYTES 4096

static __always_inline void segment_submit(struct nettap_segment *r)
{
	__u32 idx = NETTAP_RING_SEGMENTS;
	__u64 *unchecked = bpf_map_lookup_elem(&ring_unchecked, &idx);
	__u64 flags = BPF_RB_NO_WAKEUP;

	if (unchecked) {
		*unchecked += sizeof(*r) + 8;
		if (*unchecked >= SEGMENT_CHECK_BYTES) {
			*unchecked = 0;
			flags = wakeup_flags(&segments, idx,
					     bpf_ringbuf_query(&segments, BPF_RB_RING_SIZE) / 4);
		}
	}
	bpf_ringbuf_submit(r, flags);
}

/* The segments the kernel counts in an skb it received (tcp_segs_in): its
 * gso_segs, at least one. A socket's backlog joins segments that came while
 * its owner held it (tcp_add_backlog, 4.20), GRO those of one burst. */
static __always_inline __u16 skb_segs(const struct sk_buff *skb)
{
	const struct skb_shared_info *shinfo;
	__u16 segs;

	shinfo = (const void *)(BPF_CORE_READ(skb, head) + BPF_CORE_READ(skb, end));
	segs = BPF_CORE_READ(shinfo, gso_segs);
	return segs ? segs : 1;
}

/* Every segment an established socket of the node receives passes here: one
 * array read says no while no target has segments on, the connection
 * table's front door for the sockets not captured. */
NETTAP_PROG("probe=tcp_segment mech=tp_btf records=segment")
SEC("tp_btf/tcp_probe")
int BPF_PROG(tcp_segment, struct sock *sk, struct sk_buff *skb)
{
	struct nettap_capture_config *cfg = active_config();
	const struct tcp_sock *tp = (const void *)sk;
	struct nettap_segment *r;
	unsigned char *data;
	struct conn *cn;
	__u8 th[16];
	__u32 len, doff;

	if (!cfg || !(cfg->flags & NETTAP_TARGET_SEGMENTS))
		return 0;
	cn = captured_conn(sk);
	if (!cn || !(cn->wants & (1U << NETTAP_KIND_SEGMENT)))
		return 0;
	r = bpf_ringbuf_reserve(&segments, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_SEGMENTS, 1);
		return 0;
	}
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = cn->id;
	r->h.kind = NETTAP_KIND_SEGMENT;
	r->h.pid = cn->pid;
	/* skb->data is at the TCP header here: its sequence number and its
	 * length (doff, in 32-bit words) */
	data = BPF_CORE_READ(skb, data);
	len = BPF_CORE_READ(skb, len);
	if (bpf_probe_read_kernel(th, sizeof(th), data))
		__builtin_memset(th, 0, sizeof(th));
	doff = (th[12] >> 4) * 4;
	r->seq = bpf_ntohl(*(__u32 *)&th[4]);
	r->length = len > doff ? len - doff : 0;
	r->snd_cwnd = BPF_CORE_READ(tp, snd_cwnd);
	r->ssthresh = BPF_CORE_READ(tp, snd_ssthresh);
	r->srtt_us = BPF_CORE_READ(tp, srtt_us) >> 3;
	r->snd_wnd = BPF_CORE_READ(tp, snd_wnd);
	r->rcv_wnd = BPF_CORE_READ(tp, rcv_wnd);
	r->segs = skb_segs(skb);
	OBS_SOCK(r, sk, false);
	segment_submit(r);
	return 0;
}

/*
 * A captured socket's retransmit and keepalive timers as the
 * timer wheel fires them (timer:timer_expire_entry): how far behind its
 * slot the CPU ran the wheel, the wheel's rounding, and whether the owner
 * held the socket. Records on obs_events; behind_jiffies counted in the
 * obs_counters rows NETTAP_OBS_TIMERS + timer * 16 + i: i of 0..9 a
 * histogram bucket (behind_bucket), 15 their sum. And the probes those
 * timers send (timer:timer_expire_exit): probe records, counted in the rows
 * NETTAP_OBS_WAKEUPS + NETTAP_WAKEUP_*.
 */

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
NETTAP_PROG("probe=tcp_timer mech=tp_btf records=timer,probe")
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
	cn = conn_lookup_btf(sk);
	if (!cn) {
		which = NETTAP_TIMER_KEEPALIVE;
		/* sk_timer, or icsk_keepalive_timer (core_fixes.bpf.h) */
		sk = (const struct sock *)((void *)timer - keepalive_timer_offset());
		cn = conn_lookup_btf(sk);
	}
	if (cn && cn->pending) /* captured_conn's, once (one copy of its code) */
		cn = conn_resolve(sk, cn);
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
NETTAP_PROG("probe=tcp_timer_exit mech=tp_btf records=probe")
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
