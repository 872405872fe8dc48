/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * dns_func.bpf.h: the DNS programs' kernel-function mechanisms (fentry/fexit,
 * else kprobe/kretprobe), on the inet sockets' send and receive:
 * inet_sendmsg and inet6_sendmsg, inet_recvmsg and inet6_recvmsg, which
 * every send and receive call of a UDP or TCP socket goes through (write,
 * sendto, sendmsg, each message of a sendmmsg; read, recvfrom, recvmsg, each
 * of a recvmmsg), and nothing else: a pipe's or a file's read and write
 * never run them, as they run the syscall tracepoints of dns.bpf.h.
 *
 * The socket is an argument; the user buffers come from the msghdr's
 * iterator (core_fixes.bpf.h), and the peer's address from the kernel's
 * copy of it (msg_name). A receive is kept at its entry and published at its
 * return, as the tracepoints' are (dns_keep, dns_recv_return). `fast` as in
 * filter.bpf.h: the socket's fields by direct loads (Linux 6.2+), else
 * through bpf_probe_read_kernel.
 */
#ifndef NETTAP_DNS_FUNC_BPF_H
#define NETTAP_DNS_FUNC_BPF_H

#include "dns.bpf.h"
#include "entry_func.bpf.h"

/* The receive's "call number" of each function (syscalls' are >= 0). */
#define DNS_NR_INET  -1
#define DNS_NR_INET6 -2

/* The sock of a struct socket when it is UDP or TCP, else NULL; *tcp:
 * whether TCP. */
static __always_inline struct sock *dns_socket_sock(struct socket *sock, bool *tcp, const bool fast)
{
	struct sock *sk = fast ? KCAST(struct socket, sock)->sk : BPF_CORE_READ(sock, sk);

	if (!sk)
		return NULL;
	*tcp = sock_is_tcp(sk, fast);
	return *tcp || sock_is_udp(sk, fast) ? sk : NULL;
}

/* Does a target ask for this socket's DNS: the task's, or the socket's
 * netns? Asked after the port: the socket is an argument here, so the
 * port is the cheaper test, and most calls are not DNS. */
static __always_inline bool dns_sock_taken(struct nettap_capture_config *cfg, struct sock *sk,
					   const bool fast)
{
	return dns_task_taken(cfg) || ((cfg->flags & NETTAP_TARGET_NETNS) &&
				       netns_matches(sk, fast, NETTAP_MATCH_CAPTURE));
}

/* The socket's inode number, as the tracepoints' file_ino() finds it. */
static __always_inline __u64 socket_ino(struct socket *sock, const bool fast)
{
	if (fast)
		return KCAST(struct socket, sock)->file->f_inode->i_ino;
	return BPF_CORE_READ(sock, file, f_inode, i_ino);
}

/* What a msghdr's iterator says of its user buffers, read once per
 * program (msg_iter_read): each CO-RE choice between kernel versions' fields
 * is then made once, where the verifier sees the other as dead code. */
struct msg_bufs {
	enum nettap_iter kind;
	__u32 nr;    /* ITER_IOVEC: its iovecs */
	__u64 base;  /* ITER_UBUF: the buffer; ITER_IOVEC: the kernel array of iovecs */
	__u64 count; /* ITER_UBUF: its bytes */
	__u64 skip;  /* bytes of the first buffer already consumed */
};

static __always_inline void msg_iter_read(struct msghdr *msg, struct msg_bufs *b)
{
	__u32 raw = 0;

	b->kind = iter_kind(msg, &raw);
	b->skip = BPF_CORE_READ(msg, msg_iter.iov_offset);
	if (b->kind == NETTAP_ITER_UBUF) {
		b->base = (__u64)BPF_CORE_READ(msg, msg_iter.ubuf);
		b->count = BPF_CORE_READ(msg, msg_iter.count);
	} else if (b->kind == NETTAP_ITER_IOVEC) {
		b->base = iter_iovec(msg);
		b->nr = BPF_CORE_READ(msg, msg_iter.nr_segs);
	}
}

/* The i-th user buffer (0 when there is none), *len its length. */
static __always_inline __u64 msg_buffer(const struct msg_bufs *b, __u32 i, __u64 *len)
{
	struct iovec v = {};
	__u64 skip = i ? 0 : b->skip;

	if (b->kind == NETTAP_ITER_UBUF) {
		*len = b->count;
		return i ? 0 : b->base + skip;
	}
	if (b->kind != NETTAP_ITER_IOVEC || i >= b->nr ||
	    bpf_probe_read_kernel(&v, sizeof(v), (void *)(b->base + i * sizeof(v))) ||
	    skip > v.iov_len)
		return 0;
	*len = v.iov_len - skip;
	return (__u64)v.iov_base + skip;
}

/* A send's entry: a message to port 53 is published, a record a buffer
 * (a UDP datagram's first; a TCP send's first DNS_MMSG: glibc writes a
 * query's length and message as two). */
static __always_inline int dns_sock_send(struct socket *sock, struct msghdr *msg, const bool fast)
{
	struct nettap_capture_config *cfg = active_config();
	struct msg_bufs bufs = {};
	struct dns_peer peer = {};
	__u64 name = 0, ino;
	bool tcp = false;
	struct sock *sk;

	if (!cfg)
		return 0;
	sk = dns_socket_sock(sock, &tcp, fast);
	if (!sk)
		return 0;
	if (tcp) {
		peer.port = sock_port(sk, fast);
	} else {
		name = (__u64)BPF_CORE_READ(msg, msg_name);
		udp_peer(&peer, sk, name, true);
	}
	if (peer.port != DNS_PORT || !dns_sock_taken(cfg, sk, fast))
		return 0;
	ino = socket_ino(sock, fast);
	if (!tcp)
		dns_remember(ino, &peer);
	msg_iter_read(msg, &bufs);
	for (__u32 i = 0; i < DNS_MMSG; i++) {
		__u64 len = 0, buf = msg_buffer(&bufs, i, &len);

		if (!buf)
			break;
		dns_publish(sk, ino, buf, len, name, true, NETTAP_DIR_EGRESS, tcp, NULL, fast);
		if (!tcp)
			break;
	}
	return 0;
}

/* A receive's entry: kept (dns_keep) when its socket sent a query, or is a
 * TCP socket connected to port 53. */
static __always_inline int dns_sock_recv(long nr, struct socket *sock, struct msghdr *msg,
					 const bool fast)
{
	struct nettap_capture_config *cfg = active_config();
	struct msg_bufs bufs = {};
	__u64 ino, buf, len = 0;
	bool tcp = false;
	struct sock *sk;

	if (!cfg)
		return 0;
	sk = dns_socket_sock(sock, &tcp, fast);
	/* a TCP socket's port first (cheap); a UDP socket's mark needs its inode */
	if (!sk || (tcp && sock_port(sk, fast) != DNS_PORT) || !dns_sock_taken(cfg, sk, fast))
		return 0;
	ino = socket_ino(sock, fast);
	if (!dns_recv_sock(sk, ino, tcp, fast))
		return 0;
	msg_iter_read(msg, &bufs);
	buf = msg_buffer(&bufs, 0, &len);
	if (!buf)
		return 0;
	return dns_keep(nr, sk, ino, buf, tcp ? 0 : (__u64)BPF_CORE_READ(msg, msg_name), true, tcp);
}

// clang-format off
/* A send function's programs, fentry and kprobe, in both variants. */
#define NETTAP_DNS_SEND(func)								\
	NETTAP_PROG("probe=dns mech=fentry variant=fast")				\
	SEC("fentry/" #func)								\
	int BPF_PROG(dns_##func##_fentry, struct socket *sock, struct msghdr *msg)	\
	{ return dns_sock_send(sock, msg, FAST); }					\
	NETTAP_PROG("probe=dns mech=fentry variant=compat")				\
	SEC("fentry/" #func)								\
	int BPF_PROG(dns_##func##_fentry_compat, struct socket *sock, struct msghdr *msg) \
	{ return dns_sock_send(sock, msg, COMPAT); }					\
	NETTAP_PROG("probe=dns mech=kprobe variant=fast")				\
	SEC("kprobe/" #func)								\
	int BPF_KPROBE(dns_##func##_kprobe, struct socket *sock, struct msghdr *msg)	\
	{ return dns_sock_send(sock, msg, FAST); }					\
	NETTAP_PROG("probe=dns mech=kprobe variant=compat")				\
	SEC("kprobe/" #func)								\
	int BPF_KPROBE(dns_##func##_kprobe_compat, struct socket *sock, struct msghdr *msg) \
	{ return dns_sock_send(sock, msg, COMPAT); }

/* A receive function's: entry and return, fentry/fexit and kprobe/kretprobe. */
#define NETTAP_DNS_RECV(func, nr)							\
	NETTAP_PROG("probe=dns mech=fentry variant=fast")				\
	SEC("fentry/" #func)								\
	int BPF_PROG(dns_##func##_fentry, struct socket *sock, struct msghdr *msg)	\
	{ return dns_sock_recv(nr, sock, msg, FAST); }					\
	NETTAP_PROG("probe=dns mech=fentry variant=compat")				\
	SEC("fentry/" #func)								\
	int BPF_PROG(dns_##func##_fentry_compat, struct socket *sock, struct msghdr *msg) \
	{ return dns_sock_recv(nr, sock, msg, COMPAT); }				\
	NETTAP_PROG("probe=dns mech=fentry variant=fast")				\
	SEC("fexit/" #func)								\
	int dns_##func##_fexit(void *ctx)						\
	{ return dns_recv_return(nr, func_ret(ctx), FAST); }				\
	NETTAP_PROG("probe=dns mech=fentry variant=compat")				\
	SEC("fexit/" #func)								\
	int dns_##func##_fexit_compat(void *ctx)					\
	{ return dns_recv_return(nr, func_ret(ctx), COMPAT); }				\
	NETTAP_PROG("probe=dns mech=kprobe variant=fast")				\
	SEC("kprobe/" #func)								\
	int BPF_KPROBE(dns_##func##_kprobe, struct socket *sock, struct msghdr *msg)	\
	{ return dns_sock_recv(nr, sock, msg, FAST); }					\
	NETTAP_PROG("probe=dns mech=kprobe variant=compat")				\
	SEC("kprobe/" #func)								\
	int BPF_KPROBE(dns_##func##_kprobe_compat, struct socket *sock, struct msghdr *msg) \
	{ return dns_sock_recv(nr, sock, msg, COMPAT); }				\
	NETTAP_PROG("probe=dns mech=kprobe variant=fast")				\
	SEC("kretprobe/" #func)								\
	int BPF_KRETPROBE(dns_##func##_kretprobe, int ret)				\
	{ return dns_recv_return(nr, ret, FAST); }					\
	NETTAP_PROG("probe=dns mech=kprobe variant=compat")				\
	SEC("kretprobe/" #func)								\
	int BPF_KRETPROBE(dns_##func##_kretprobe_compat, int ret)			\
	{ return dns_recv_return(nr, ret, COMPAT); }
// clang-format on

NETTAP_DNS_SEND(inet_sendmsg)
NETTAP_DNS_SEND(inet6_sendmsg)
NETTAP_DNS_RECV(inet_recvmsg, DNS_NR_INET)
NETTAP_DNS_RECV(inet6_recvmsg, DNS_NR_INET6)

#endif /* NETTAP_DNS_FUNC_BPF_H */
