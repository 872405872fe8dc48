/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * segment.bpf.h: the segments an established captured socket receives
 * (tcp:tcp_probe, at the top of tcp_rcv_established), for the sockets of a
 * target with segments on (conn.segments, decided in the socket's owner's
 * task: publish_owner, or at a passive open by the socket targets). A high
 * rate: records on a ring of their own, segments, so that a flood of them
 * costs no lifecycle record its room on obs_events.
 */
#ifndef NETTAP_SEGMENT_BPF_H
#define NETTAP_SEGMENT_BPF_H

#include <bpf/bpf_tracing.h>
#include "obs.bpf.h"

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

/* Every segment an established socket of the node receives passes here: one
 * array read says no while no target has segments on, the connection
 * table's front door for the sockets not captured. */
NETTAP_PROG("probe=tcp_segment mech=tp_btf")
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
	if (!cn || !cn->segments)
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
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	OBS_SOCK(r, sk, false);
	segment_submit(r);
	return 0;
}

#endif /* NETTAP_SEGMENT_BPF_H */
