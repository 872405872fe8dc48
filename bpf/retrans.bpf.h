/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * retrans.bpf.h: segments sent again. A captured socket's retransmissions
 * (tcp:tcp_retransmit_skb), each with the recovery that sent it, and the
 * SYN-ACKs a listener of a captured port sends again
 * (tcp:tcp_retransmit_synack): records on obs_events, counts in the
 * obs_counters rows NETTAP_OBS_RETRANS + NETTAP_RETRANS_*.
 */
#ifndef NETTAP_RETRANS_BPF_H
#define NETTAP_RETRANS_BPF_H

#include <bpf/bpf_tracing.h>
#include "filter.bpf.h"
#include "obs.bpf.h"

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
NETTAP_PROG("probe=tcp_retransmit mech=tp_btf")
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
 * open's rule, state_decide in tcp.bpf.c), on the request's own ports and
 * namespace; the header's conn_id and pid are 0. A request starts with the
 * same struct sock_common as a socket, so the socket readers read it. */
NETTAP_PROG("probe=tcp_synack_retransmit mech=tp_btf")
SEC("tp_btf/tcp_retransmit_synack")
int BPF_PROG(tcp_synack_retransmit, const struct sock *sk, const struct request_sock *req)
{
	struct nettap_capture_config *cfg = active_config();
	struct nettap_synack_retransmit *r;
	struct nettap_hdr *h;

	if (!cfg || !sock_matches(cfg, (struct sock *)req, false))
		return 0;
	obs_count(NETTAP_OBS_RETRANS + NETTAP_RETRANS_SYNACK);
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

#endif /* NETTAP_RETRANS_BPF_H */
