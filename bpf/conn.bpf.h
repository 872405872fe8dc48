/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * conn.bpf.h: the captured-connection table (keyed by socket address,
 * removed at TCP_CLOSE by the lifecycle program) and the counters and log
 * records every program shares.
 */
#ifndef NETTAP_CONN_BPF_H
#define NETTAP_CONN_BPF_H

#include "vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "tcp.h"
#include "maps.bpf.h"
#include "core_fixes.bpf.h"

#define AF_INET		2
#define AF_INET6	10
#define IPPROTO_TCP	6
#define SOCK_STREAM	1
#define TCP_ESTABLISHED 1
#define TCP_SYN_SENT	2
#define TCP_SYN_RECV	3
#define TCP_CLOSE	7
#define TCP_LISTEN	10

struct conn {
	__u64 id;
	__u64 start_ns;
	union {
		struct {
			__u64 tx_off; /* also the bytes sent */
			__u64 rx_off; /* also the bytes received */
			__u64 tx_calls;
			__u64 rx_calls;
			__u64 tls_tx_off; /* TLS plaintext sent (tls.bpf.h) */
			__u64 tls_rx_off; /* TLS plaintext received */
		};
		/* While pending (below): its connecting task, for its owner
		 * record once it is kept; zeroed then, before any byte moves. */
		struct {
			char comm[16];
			__u64 cgroup_id;
			__u32 tid;
		} connector;
	};
	__u32 pid;
	__u8 closed;	      /* reached TCP_CLOSE, its eof published: kept until the socket is
		       * destroyed (a reset it sends follows its CLOSE), then removed */
	__u8 pending;	      /* CONN_PENDING_*: a new socket under capture.sample_connections,
		       * decided once its tuple is whole (lifecycle.bpf.c): nothing
		       * published yet */
	__u8 owned;	      /* its owner record is published (obs.bpf.h) */
	__u32 wants;	      /* bit (1 << NETTAP_KIND_*): the record kinds its targets ask for,
		       * decided with its capture (filter.bpf.h: target_kinds; 0:
		       * capture.records) */
	__u32 established_us; /* start_ns to ESTABLISHED (lifecycle.bpf.c), for its eof */
};

/* conn.pending: which first state waits for the socket's tuple */
#define CONN_PENDING_CONNECT 1 /* CLOSE -> SYN_SENT: the local port is bound after it */
#define CONN_PENDING_BIRTH \
	2 /* LISTEN -> SYN_RECV: before Linux 6.x, the child's peer
				* is set after it (inet_csk_clone_lock) */

/* Preallocated on every kernel (the loader clears BPF_F_NO_PREALLOC): the
 * table gains an entry per captured connection, at connection rate and in
 * softirq, where Linux 6.1's bpf_mem_alloc can fail while its per-CPU cache
 * waits for an irq_work refill (the 6.1 guest of the kernel matrix lost 2-4
 * of 2,000 connections of a storm: no entry, so no eof). A preallocated
 * table fails only when full. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC); /* memory grows with use */
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct conn);
} capture_conns NETTAP_MAP("prealloc=always") SEC(".maps");

/* Entries in capture_conns, so user space need not walk the map to know. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} capture_conns_live SEC(".maps");

/* The table's front door: per slot, how many entries' sockets hash to it.
 * The lifecycle programs run for every socket of the node, nearly all of
 * them not captured; a table lookup hashes the key and reads a bucket of
 * its 1 MiB at random, vmalloc'ed. 1,024 slots, two to a u64 (an array's
 * values are 8-byte aligned): one 4 KiB page. Measured here (bench/
 * probe_cost.py), a socket not captured cost tcp_state 232 ns a run with
 * the table alone, 139 with 8,192 slots, 125-132 with these, 103 with 16:
 * the larger the array, the likelier its line is cold; the fewer the slots,
 * the likelier one is taken by a captured socket's (about live captured
 * connections / 1,024) and the table is asked after all. With the porch
 * below: docs/benchmarks.md ("Lifecycle programs"). A slot at 0
 * means: no entry. Counted up before an insert and down after a delete, so
 * a slot is never below its entries; from every program type and on every
 * kernel (socket-local storage is written by tracing programs only, since
 * Linux 5.11, and the send path's fallbacks are not tracing programs). */
#define NETTAP_CONN_SLOTS_BITS 10
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << (NETTAP_CONN_SLOTS_BITS - 1));
	__type(key, __u32);
	__type(value, __u64); /* slot 2n in the low half of word n, 2n + 1 in the high */
} capture_conns_slots SEC(".maps");

/* Its porch: per group of 64 slots, how many entries' sockets hash into
 * the group. The 16 counts are one cache line, read by every lifecycle run
 * of the node, so it stays warm where a slot's line, one of 64, has gone
 * cold since a socket's last state change: while fewer than about 16
 * captured connections are live, most sockets are told "not captured" by
 * this line alone. Kept as the slots are (up before an insert, down after
 * a delete). */
#define NETTAP_CONN_GROUPS 16
struct nettap_conn_groups {
	__u32 n[NETTAP_CONN_GROUPS];
};

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_conn_groups);
} capture_conns_groups SEC(".maps");

/* Connection ids for the compat programs: per-CPU sequences (see conn_get). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} conn_id_seq NETTAP_MAP("variant=compat") SEC(".maps");

NETTAP_SHARED __u64 next_conn_id NETTAP_INIT(1);

/* Adds whose result is not used compile to BPF_XADD (every kernel); only a
 * fetching add (BPF_ATOMIC | BPF_FETCH) needs Linux 5.12. */
static __always_inline void conns_live_add(__s64 d)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&capture_conns_live, &zero);

	if (n)
		__sync_fetch_and_add(n, d);
}

/* A socket's slot: its address, measured from this object's .data (a
 * fixed address while it is loaded), less the cache-line bits,
 * Fibonacci-hashed. */
static __always_inline __u32 conn_slot_of(__u64 rel)
{
	return (__u32)(((rel >> 6) * 0x9E3779B97F4A7C15ULL) >> (64 - NETTAP_CONN_SLOTS_BITS));
}

/* Slot i's word, and the add that counts one there (1 or 1 << 32). */
static __always_inline __u64 *conn_slot_word(__u32 i, __u64 *one)
{
	__u32 w = i >> 1;

	*one = (i & 1) ? 1ULL << 32 : 1;
	return bpf_map_lookup_elem(&capture_conns_slots, &w);
}

/* The slot of any socket address (a number, or a pointer of any kind):
 * both addresses copied as bytes from the stack, where a copy is a number
 * (a helper call; for inserts and deletes). */
static __always_inline __u32 conn_slot_exact(__u64 key)
{
	__u64 addrs[2] = {}, from[2] = { key, (__u64)&next_conn_id };

	bpf_probe_read_kernel(addrs, sizeof(addrs), from);
	return conn_slot_of(addrs[0] - addrs[1]);
}

/* The same for a BTF pointer, with no helper call and no memory touched:
 * the verifier refuses to shift or multiply a pointer, but the difference
 * of two pointers is a number to a program loaded with CAP_PERFMON (or
 * root), which nettap needs anyway. */
static __always_inline __u32 conn_slot_btf(const struct sock *sk)
{
	__u64 rel;

	asm volatile("%[rel] = %[sk]\n\t%[rel] -= %[base]"
		     : [rel] "=&r"(rel)
		     : [sk] "r"(sk), [base] "r"(&next_conn_id));
	return conn_slot_of(rel);
}

/* Slot i's group count. */
static __always_inline __u32 *conn_group(__u32 i)
{
	struct nettap_conn_groups *g;
	__u32 zero = 0;

	g = bpf_map_lookup_elem(&capture_conns_groups, &zero);
	return g ? &g->n[(i >> (NETTAP_CONN_SLOTS_BITS - 4)) & (NETTAP_CONN_GROUPS - 1)] : NULL;
}

/* The entry of a socket the lifecycle programs see (a BTF pointer), NULL
 * when it has none: nearly always told by its group or its slot. */
static __always_inline struct conn *conn_lookup_btf(const struct sock *sk)
{
	__u32 i = conn_slot_btf(sk), *g = conn_group(i);
	__u64 key = (__u64)sk, one, *w;

	if (g && !*g)
		return NULL;
	w = conn_slot_word(i, &one);
	if (w && !(*w & (one * 0xffffffffULL)))
		return NULL;
	return bpf_map_lookup_elem(&capture_conns, &key);
}

/* A new entry (BPF_NOEXIST: a racing thread may have inserted it first). */
static __always_inline long conn_insert(__u64 key, struct conn *fresh)
{
	__u32 i = conn_slot_exact(key), *g = conn_group(i);
	__u64 one, *w = conn_slot_word(i, &one);
	long err;

	if (!w || !g)
		return -1;
	__sync_fetch_and_add(g, 1);
	__sync_fetch_and_add(w, one);
	err = bpf_map_update_elem(&capture_conns, &key, fresh, BPF_NOEXIST);
	if (err) {
		__sync_fetch_and_add(w, -one);
		__sync_fetch_and_add(g, -1);
	} else
		conns_live_add(1);
	return err;
}

static __always_inline void conn_delete(__u64 key)
{
	__u32 i, *g;
	__u64 one, *w;

	if (bpf_map_delete_elem(&capture_conns, &key))
		return;
	conns_live_add(-1);
	i = conn_slot_exact(key);
	w = conn_slot_word(i, &one);
	if (w)
		__sync_fetch_and_add(w, -one);
	g = conn_group(i);
	if (g)
		__sync_fetch_and_add(g, -1);
}

static __always_inline void count_drop(__u32 ring, __u64 n)
{
	__u64 *d = bpf_map_lookup_elem(&ringbuf_drops, &ring);

	if (d)
		__sync_fetch_and_add(d, n);
}

/* An insert into map (NETTAP_MAP_*) refused: full, or no memory. */
static __always_inline void count_insert_failure(__u32 map)
{
	__u64 *n = bpf_map_lookup_elem(&map_insert_failures, &map);

	if (n)
		__sync_fetch_and_add(n, 1);
}

static __always_inline struct nettap_probe_counters *counters(__u32 probe)
{
	return bpf_map_lookup_elem(&probe_counters, &probe);
}

static __always_inline void emit_log(__u32 code, __u32 probe, __u64 conn_id, __u64 a0, __u64 a1)
{
	struct nettap_log *l = bpf_ringbuf_reserve(&logs, sizeof(*l), 0);
	__u64 id = bpf_get_current_pid_tgid();

	if (!l) {
		count_drop(NETTAP_RING_LOGS, 1);
		return;
	}
	l->h.ts_ns = bpf_ktime_get_ns();
	l->h.conn_id = conn_id;
	l->h.kind = NETTAP_KIND_LOG;
	l->h.pid = id >> 32;
	l->code = code;
	l->probe = probe;
	l->arg0 = a0;
	l->arg1 = a1;
	l->tid = (__u32)id;
	bpf_get_current_comm(l->comm, sizeof(l->comm));
	__builtin_memset(l->pad0, 0, sizeof(l->pad0));
	bpf_ringbuf_submit(l, 0);
}

/* Per ring, the reader's consumer position (plus one, so 0 means none) when
 * a program last forced a wakeup. */
#define NETTAP_RING_SLOTS 8 /* a power of two >= NETTAP_RING_COUNT: the index is masked */
_Static_assert(NETTAP_RING_COUNT <= NETTAP_RING_SLOTS, "ring_woken_cons too small");
NETTAP_SHARED __u64 ring_woken_cons[NETTAP_RING_SLOTS] SEC(".data") NETTAP_INIT({});

static __always_inline __u64 wakeup_flags(void *ring, __u32 ring_idx, __u32 threshold)
{
	__u64 cons, *woken;

	/* No wakeup per record: the reader polls on a short timer, and is
	 * woken only once enough is pending that waiting could overflow.
	 * threshold: that ring's own (capture_config.*wakeup_bytes). */
	if (bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA) < threshold)
		return BPF_RB_NO_WAKEUP;
	/* Once woken, the reader drains everything there is: until it has
	 * consumed something, another wakeup only costs this CPU an
	 * interrupt (a self-IPI, a VM exit on a guest) per submit. A racing
	 * write here costs at most one extra wakeup. */
	if (ring_idx >= NETTAP_RING_COUNT)
		return BPF_RB_FORCE_WAKEUP;
	/* Masked behind a barrier: Linux 6.1's verifier loses the bound of
	 * ring_idx reloaded from the stack (its address went to a helper), and
	 * clang would drop a mask it can prove. */
	barrier_var(ring_idx);
	woken = &ring_woken_cons[ring_idx & (NETTAP_RING_SLOTS - 1)];
	cons = bpf_ringbuf_query(ring, BPF_RB_CONS_POS) + 1;
	if (*woken == cons)
		return BPF_RB_NO_WAKEUP;
	*woken = cons;
	return BPF_RB_FORCE_WAKEUP;
}

/* wakeup_flags, with the fill looked at only once this CPU has published
 * check_bytes since its last look (user space bounds how late that makes
 * the wakeup), not at every call: the look is a helper call that reads the
 * producer's and the reader's positions, lines other CPUs write. */
static __always_inline __u64 wakeup_flags_every(void *ring, __u32 ring_idx, __u32 threshold,
						__u64 bytes, __u32 check_bytes)
{
	__u64 *unchecked = check_bytes ? bpf_map_lookup_elem(&ring_unchecked, &ring_idx) : NULL;

	if (unchecked) {
		*unchecked += bytes;
		if (*unchecked < check_bytes)
			return BPF_RB_NO_WAKEUP;
		*unchecked = 0;
	}
	return wakeup_flags(ring, ring_idx, threshold);
}

#define SKC_OFF(field) bpf_core_field_offset(struct sock_common, field)

/* read_addrs by bpf_probe_read_kernel: the head of struct sock_common
 * (skc_addrpair, skc_hash, skc_portpair, skc_family: every kernel so far)
 * in one read where CO-RE finds it so, where there were five; an IPv6
 * socket's two addresses (skc_v6_daddr, skc_v6_rcv_saddr) in one more. */
static __always_inline void read_addrs_compat(struct sock *sk, __u16 *family, __u16 *sport,
					      __u16 *dport, __u8 *saddr, __u8 *daddr)
{
	if (SKC_OFF(skc_rcv_saddr) == SKC_OFF(skc_daddr) + 4 &&
	    SKC_OFF(skc_dport) == SKC_OFF(skc_daddr) + 12 &&
	    SKC_OFF(skc_num) == SKC_OFF(skc_daddr) + 14 &&
	    SKC_OFF(skc_family) == SKC_OFF(skc_daddr) + 16) {
		struct {
			__be32 daddr;
			__be32 rcv_saddr;
			__u32 hash;
			__be16 dport;
			__u16 num;
			__u16 family;
		} h = {};

		bpf_probe_read_kernel(&h, 18, (void *)sk + SKC_OFF(skc_daddr));
		*family = h.family;
		*sport = h.num;
		*dport = bpf_ntohs(h.dport);
		*(__u32 *)saddr = h.rcv_saddr;
		*(__u32 *)daddr = h.daddr;
	} else {
		*family = BPF_CORE_READ(sk, __sk_common.skc_family);
		*sport = BPF_CORE_READ(sk, __sk_common.skc_num);
		*dport = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
		BPF_CORE_READ_INTO((__u32 *)saddr, sk, __sk_common.skc_rcv_saddr);
		BPF_CORE_READ_INTO((__u32 *)daddr, sk, __sk_common.skc_daddr);
	}
	if (*family != AF_INET6)
		return;
	if (SKC_OFF(skc_v6_rcv_saddr) == SKC_OFF(skc_v6_daddr) + 16) {
		struct {
			__u8 daddr[16];
			__u8 saddr[16];
		} a = {};

		bpf_probe_read_kernel(&a, sizeof(a), (void *)sk + SKC_OFF(skc_v6_daddr));
		__builtin_memcpy(saddr, a.saddr, 16);
		__builtin_memcpy(daddr, a.daddr, 16);
	} else {
		bpf_core_read(saddr, 16, &sk->__sk_common.skc_v6_rcv_saddr);
		bpf_core_read(daddr, 16, &sk->__sk_common.skc_v6_daddr);
	}
}

/* A record's socket (tcp.h's nettap_ports and nettap_addrs: every record
 * about a socket has both), filled from sk: the one place that does. With
 * btf, sk is a BTF pointer read by direct loads; otherwise any kernel
 * address, read by bpf_probe_read_kernel (CO-RE relocated either way). */
static __always_inline void read_addrs(struct sock *sk, const bool btf, struct nettap_ports *p,
				       struct nettap_addrs *a)
{
	__builtin_memset(a->saddr, 0, 16);
	__builtin_memset(a->daddr, 0, 16);
	if (btf) {
		struct sock_common *c = &sk->__sk_common;

		p->family = c->skc_family;
		p->sport = c->skc_num;
		p->dport = bpf_ntohs(c->skc_dport);
		if (p->family == AF_INET6) {
			__builtin_memcpy(a->saddr, &c->skc_v6_rcv_saddr, 16);
			__builtin_memcpy(a->daddr, &c->skc_v6_daddr, 16);
		} else {
			*(__u32 *)a->saddr = c->skc_rcv_saddr;
			*(__u32 *)a->daddr = c->skc_daddr;
		}
	} else {
		read_addrs_compat(sk, &p->family, &p->sport, &p->dport, a->saddr, a->daddr);
	}
	/* tcp_set_state() releases the local port (inet_put_port zeroes
	 * skc_num) before it stores TCP_CLOSE: at close, and for data read
	 * after it (a peer reset), the socket's own inet_sport still holds it.
	 * Read past struct sock, so by bpf_probe_read_kernel in both cases. */
	if (!p->sport)
		p->sport = bpf_ntohs(BPF_CORE_READ((struct inet_sock *)sk, inet_sport));
}

/* The connection of a socket, created at its first captured call. */
static __always_inline struct conn *conn_get(__u64 key, __u32 probe, const bool fetch)
{
	struct conn *cn = bpf_map_lookup_elem(&capture_conns, &key);
	struct conn fresh = {};
	long err;

	if (cn) {
		if (!cn->closed)
			return cn;
		/* Data read after TCP_CLOSE (a peer reset): a connection of its own. */
		conn_delete(key);
	}
	if (fetch) {
		fresh.id = __sync_fetch_and_add(&next_conn_id, 1);
	} else {
		/* No fetching add before Linux 5.12: ids from a per-CPU sequence,
		 * (seq << 12) | cpu, unique while CPUs < 4096. */
		__u32 zero = 0;
		__u64 *seq = bpf_map_lookup_elem(&conn_id_seq, &zero);

		if (!seq)
			return NULL;
		__sync_fetch_and_add(seq, 1);
		fresh.id = (*seq << 12) | (bpf_get_smp_processor_id() & 0xfff);
	}
	fresh.start_ns = bpf_ktime_get_ns();
	fresh.pid = bpf_get_current_pid_tgid() >> 32;
	err = conn_insert(key, &fresh);
	cn = bpf_map_lookup_elem(&capture_conns, &key);
	if (!cn && err)
		emit_log(NETTAP_LOG_CONN_TABLE_FULL, probe, 0, -err, 0);
	return cn;
}

/* Move a stream's offset past ret bytes; returns where the call's bytes
 * start. With fetch, two threads moving bytes on one socket at once each get
 * a distinct range; without (before 5.12) they may overlap. A TLS probe
 * moves the plaintext's offsets, apart from the TCP bytes'. */
static __always_inline __u64 conn_advance(struct conn *cn, __u32 probe, long ret, const bool fetch)
{
	__u64 *off, *calls = NULL, at;

	switch (probe) {
	case NETTAP_PROBE_TCP_SENDMSG:
		off = &cn->tx_off;
		calls = &cn->tx_calls;
		break;
	case NETTAP_PROBE_TCP_RECVMSG:
		off = &cn->rx_off;
		calls = &cn->rx_calls;
		break;
	case NETTAP_PROBE_SSL_WRITE:
	case NETTAP_PROBE_GO_TLS_WRITE:
		off = &cn->tls_tx_off;
		break;
	default:
		off = &cn->tls_rx_off;
	}
	if (fetch) {
		at = __sync_fetch_and_add(off, ret);
	} else {
		at = *off;
		__sync_fetch_and_add(off, ret);
	}
	if (calls)
		__sync_fetch_and_add(calls, 1);
	return at;
}

#endif /* NETTAP_CONN_BPF_H */
