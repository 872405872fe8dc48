/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * tls.bpf.h: the state of the TLS calls in flight (SSL_write, SSL_write_ex,
 * SSL_read, SSL_read_ex of libssl: tls.bpf.c), and how each learns its
 * socket.
 *
 * No structure of libssl is read (its layout changes between versions): an
 * SSL call's socket is the one of the TCP call it makes inside itself, in
 * the same thread. The captured entry of tcp_sendmsg/tcp_recvmsg (every
 * mechanism's: enter_sock) writes its socket into the thread's open TLS
 * calls, so a TLS call is captured exactly when its TCP calls are (the same
 * targets, decided by the same filter). A read libssl serves from its own
 * buffer makes no TCP call: the socket learnt last time for that SSL object
 * of that process is kept in tls_socks, with its connection's id. That
 * association ends with the object (SSL_free), at its reset for another
 * connection (SSL_clear, which SSL_new calls too: an object born at a freed
 * one's address starts with none), and is used only while its connection is
 * the one in capture_conns: it never outlives the connection, and a
 * connection no target names never takes a captured one's identity.
 */
#ifndef NETTAP_TLS_BPF_H
#define NETTAP_TLS_BPF_H

#include "maps.bpf.h"

struct tls_key {
	__u64 pid_tgid;
	__u32 probe; /* NETTAP_PROBE_SSL_*: a write and a read in flight at once
		      * (a handshake inside SSL_read) keep apart */
	__u32 pad;
};

struct tls_call {
	__u64 ssl;	/* the SSL object */
	__u64 buf;	/* the caller's plaintext buffer */
	__u64 outp;	/* _ex: where the byte count is written */
	__u64 sk;	/* the socket, once a captured TCP call inside told it */
	__u64 start_ns; /* SSL_do_handshake: when it was called */
	__u32 ex;	/* SSL_*_ex: returns 1, the count in *outp */
	__u32 pad;
};

/* Per thread and probe: the TLS call between its entry and its return. A
 * thread that dies inside a call (its return never runs) has its entries
 * removed as it ends (tls_thread_end); an insert refused is counted
 * (map_insert_failures). */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 4096);
	__type(key, struct tls_key);
	__type(value, struct tls_call);
} tls_calls SEC(".maps");

struct tls_sock_key {
	__u64 ssl;
	__u32 tgid;
	__u32 pad;
};

struct tls_sock {
	__u64 sk;      /* the socket */
	__u64 conn_id; /* its connection's id (struct conn) when learnt */
};

/* (process, SSL object) -> its socket, as its last TCP call inside a TLS
 * call told it; the least recently used go first. */
NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct tls_sock_key);
	__type(value, struct tls_sock);
} tls_socks SEC(".maps");

/* TLS calls in flight per slot of the thread id (inflight_slot's), so the
 * captured TCP entry knows with one load that its thread has none. */
NETTAP_SHARED __u32 tls_slots[NETTAP_INFLIGHT_SLOTS] SEC(".bss.tls");

static __always_inline __u32 *tls_slot(__u64 pid_tgid)
{
	return &tls_slots[thread_slot(pid_tgid)];
}

/* A captured TCP call on sk began in this thread: the thread's TLS calls
 * that have no socket yet take it. */
static __always_inline void tls_learn(__u64 pid_tgid, __u64 sk)
{
	struct tls_key key = { .pid_tgid = pid_tgid };
	struct tls_call *f;

	if (!*tls_slot(pid_tgid))
		return;
	key.probe = NETTAP_PROBE_SSL_WRITE;
	f = bpf_map_lookup_elem(&tls_calls, &key);
	if (f && !f->sk)
		f->sk = sk;
	key.probe = NETTAP_PROBE_SSL_READ;
	f = bpf_map_lookup_elem(&tls_calls, &key);
	if (f && !f->sk)
		f->sk = sk;
	key.probe = NETTAP_PROBE_SSL_HANDSHAKE;
	f = bpf_map_lookup_elem(&tls_calls, &key);
	if (f && !f->sk)
		f->sk = sk;
}

/* A thread ends (inflight_exit, lifecycle.bpf.c): the TLS calls it was inside go
 * with it, so no dead thread holds an entry of tls_calls (4,096 of them
 * stopped TLS capture for everyone) or a count in its slot. One load when
 * it had none. */
static __always_inline void tls_thread_end(__u64 pid_tgid)
{
	struct tls_key key = { .pid_tgid = pid_tgid };
	__u32 *slot = tls_slot(pid_tgid);

	if (!*slot)
		return;
	key.probe = NETTAP_PROBE_SSL_WRITE;
	if (!bpf_map_delete_elem(&tls_calls, &key))
		__sync_fetch_and_add(slot, -1);
	key.probe = NETTAP_PROBE_SSL_READ;
	if (!bpf_map_delete_elem(&tls_calls, &key))
		__sync_fetch_and_add(slot, -1);
	key.probe = NETTAP_PROBE_SSL_HANDSHAKE;
	if (!bpf_map_delete_elem(&tls_calls, &key))
		__sync_fetch_and_add(slot, -1);
}

#endif /* NETTAP_TLS_BPF_H */
