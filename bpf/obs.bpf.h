/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * obs.bpf.h: what a captured socket's life puts on the obs_events ring (its
 * owner, states, resets, errors, destruction) and into the obs_counters rows.
 * Every record here is about a connection of the table (conn.bpf.h): its
 * header carries that connection's id and pid.
 */
#ifndef NETTAP_OBS_BPF_H
#define NETTAP_OBS_BPF_H

#include "filter.bpf.h"

/* A record of size bytes on obs_events, its header filled for cn; NULL when
 * the config does not ask for this kind, or (the drop counted) when the ring
 * is full. */
static __always_inline void *obs_reserve(__u32 size, const __u32 kind, const struct conn *cn)
{
	struct nettap_hdr *h;
	__u32 zero = 0;

	if (!conn_wants(bpf_map_lookup_elem(&capture_config, &zero), cn, kind))
		return NULL;
	h = bpf_ringbuf_reserve(&obs_events, size, 0);
	if (!h) {
		count_drop(NETTAP_RING_OBS_EVENTS, 1);
		return NULL;
	}
	h->ts_ns = bpf_ktime_get_ns();
	h->conn_id = cn->id;
	h->kind = kind;
	h->pid = cn->pid;
	return h;
}

static __always_inline void obs_submit(void *r)
{
	struct nettap_capture_config *cfg;
	__u32 zero = 0;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	bpf_ringbuf_submit(r, cfg ? wakeup_flags(&obs_events, NETTAP_RING_OBS_EVENTS,
						 cfg->obs_wakeup_bytes)
				  : BPF_RB_NO_WAKEUP);
}

/* A record's socket: family, ports, addresses and network namespace (every
 * obs_events kind has these fields: tcp.h's nettap_ports, nettap_addrs and
 * netns, or nettap_netns_addrs). btf: sk is a BTF pointer (read_addrs). */
static __always_inline void obs_sock(const void *sk, const bool btf, struct nettap_ports *p,
				     struct nettap_addrs *a, __u32 *netns)
{
	read_addrs((struct sock *)sk, btf, p, a);
	*netns = BPF_CORE_READ((struct sock *)sk, __sk_common.skc_net.net, ns.inum);
}

/* obs_sock for a record with a nettap_netns_addrs (most kinds). */
#define OBS_SOCK(r, sk, btf) obs_sock(sk, btf, &(r)->ports, &(r)->at.addrs, &(r)->at.netns)

/* The socket's state then, and the padding after it (the kinds recorded
 * outside a state change: reset, error, destroy). */
#define OBS_STATE(r, sk)                                                                \
	do {                                                                            \
		(r)->state = BPF_CORE_READ((struct sock *)(sk), __sk_common.skc_state); \
		(r)->pad0 = 0;                                                          \
	} while (0)

static __always_inline void obs_add(__u32 row, __u64 n)
{
	struct nettap_obs_counters *c;
	__u32 zero = 0;

	/* Bounded by a mask the verifier sees (NETTAP_OBS_ROWS is a power of
	 * two): clang drops a bound it can prove, and Linux 6.1's verifier
	 * loses the bounds of row's OR-ed parts ("math between map_value
	 * pointer and register with unbounded min value"). */
	asm volatile("" : "+r"(row));
	row &= NETTAP_OBS_ROWS - 1;
	c = bpf_map_lookup_elem(&obs_counters, &zero);
	if (c) /* per-CPU, added atomically for PREEMPT_RT (maps.bpf.h) */
		__sync_fetch_and_add(&c->rows[row], n);
}

static __always_inline void obs_count(__u32 row)
{
	obs_add(row, 1);
}

/* ring obs_events: the owner of a captured socket: the current task or, for
 * a pending connect kept (kept), the connecting task as its entry kept it;
 * cn->pid is already the owner's. */
static __always_inline void owner_record(const struct sock *sk, struct conn *cn, __u8 via,
					 const bool btf, const bool kept)
{
	struct nettap_capture_config *cfg;
	struct nettap_owner *r;
	__u32 zero = 0;

	r = obs_reserve(sizeof(*r), NETTAP_KIND_OWNER, cn);
	if (!r)
		return;
	if (kept) {
		r->cgroup_id = cn->connector.cgroup_id;
		r->tid = cn->connector.tid;
		__builtin_memcpy(r->comm, cn->connector.comm, sizeof(r->comm));
	} else {
		r->cgroup_id = bpf_get_current_cgroup_id();
		r->tid = (__u32)bpf_get_current_pid_tgid();
		bpf_get_current_comm(r->comm, sizeof(r->comm));
	}
	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	r->sample = cfg && cfg->sample_connections ? cfg->sample_connections : 1;
	r->pad1 = 0;
	r->via = via;
	r->pad0 = 0;
	OBS_SOCK(r, sk, btf);
	obs_submit(r);
}

/* The owner of a captured socket: the current task, once per connection
 * (cn->owned). */
static __always_inline void publish_owner(const struct sock *sk, struct conn *cn, __u8 via,
					  const bool btf)
{
	cn->owned = 1;
	cn->wants |= target_kinds(sk, btf, true); /* in its owner's task: the task targets too */
	owner_record(sk, cn, via, btf, false);
}

/* ring obs_events: a state change of a captured socket, at ts (0: now). */
static __always_inline void state_record(const struct sock *sk, struct conn *cn, int oldstate,
					 int newstate, __u64 ts)
{
	struct nettap_state *r;

	r = obs_reserve(sizeof(*r), NETTAP_KIND_STATE, cn);
	if (!r)
		return;
	if (ts)
		r->h.ts_ns = ts;
	r->oldstate = oldstate;
	r->newstate = newstate;
	r->pad0 = 0;
	obs_sock(sk, false, &r->ports, &r->addrs, &r->netns);
	obs_submit(r);
}

/* A pending socket whose call was captured (its entry sampled it in):
 * kept. Met first by a call's return only where tcp_state missed a run (the
 * kernel counts its misses): its owner comes then as its first call's, and
 * its first state is not recorded. */
static __always_inline void conn_kept(struct conn *cn)
{
	__builtin_memset(&cn->connector, 0, sizeof(cn->connector));
	cn->pending = 0;
}

/* A pending socket (lifecycle.bpf.c: state_decide) met again by a lifecycle
 * program, its tuple whole now (sk read as any kernel address: tcp_timer's
 * is computed from its timer's). Kept, it publishes what its first state
 * would have: a connect its owner, as the connecting task was, and its
 * CLOSE -> SYN_SENT; a child its LISTEN -> SYN_RECV (each at the socket's
 * start), and carries on. Left out, its entry goes and it is counted. */
static __always_inline struct conn *conn_resolve(const struct sock *sk, struct conn *cn)
{
	struct nettap_capture_config *cfg;
	__u64 key = (__u64)sk;
	__u32 zero = 0;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	if (cfg && !sample_keep(cfg, (struct sock *)sk, false)) {
		conn_delete(key);
		obs_count(NETTAP_OBS_SAMPLED);
		return NULL;
	}
	if (cn->pending == CONN_PENDING_CONNECT) {
		cn->owned = 1;
		owner_record(sk, cn, NETTAP_VIA_CONNECT, false, true);
		conn_kept(cn);
		obs_count(NETTAP_OBS_STATES + TCP_CLOSE * 16 + TCP_SYN_SENT);
		state_record(sk, cn, TCP_CLOSE, TCP_SYN_SENT, cn->start_ns);
	} else {
		conn_kept(cn);
		obs_count(NETTAP_OBS_STATES + TCP_LISTEN * 16 + TCP_SYN_RECV);
		state_record(sk, cn, TCP_LISTEN, TCP_SYN_RECV, cn->start_ns);
	}
	return cn;
}

/* The captured connection of a socket, NULL when it has none (or its
 * connect was sampled out just now). */
static __always_inline struct conn *captured_conn(const struct sock *sk)
{
	struct conn *cn = conn_lookup_btf(sk);

	return cn && cn->pending ? conn_resolve(sk, cn) : cn;
}

#endif /* NETTAP_OBS_BPF_H */
