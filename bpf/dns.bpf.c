// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * dns.bpf.c: the DNS messages captured workloads exchange with port 53, over
 * UDP and TCP, as records on the dns ring (user space decodes them:
 * exporter/capture/dns.py). A query is published at its send's entry, from
 * the caller's buffer; a UDP socket that sent one is then remembered
 * (dns_socks), and a receive on it, or on a TCP socket connected to port
 * 53, is published at its return. Attached only while capture.dns is on
 * (exporter/kernel/dns.py), by one of two mechanisms: the kernel-function
 * programs below (fentry/fexit or kprobe/kretprobe on the inet
 * socket calls, so only socket calls pay), or, where the kernel has neither,
 * the syscall tracepoints below (sendto, sendmsg, sendmmsg, write, writev;
 * recvfrom, recvmsg, read), which every call of those of the node runs.
 *
 * The filter is the TCP one's, cheapest test first: a task target (pid,
 * cgroup) or a port target on 53 decides without the socket; a netns target
 * needs it. Only then is the fd's socket looked at: UDP, and the peer's port.
 */
#include "entry_tp.bpf.h"
#include "entry_func.bpf.h"

#define IPPROTO_UDP    17
#define SOCK_DGRAM     2
#define DNS_PORT       53
#define DNS_MMSG       4  /* messages of one sendmmsg looked at (glibc sends 2: A and AAAA) */
#define MMSGHDR_STRIDE 64 /* sizeof(struct mmsghdr): a user_msghdr and an unsigned int, padded */

/* A peer a UDP query went to: an answer is taken only from it. */
#define DNS_PEERS 4 /* peers a socket remembers (musl asks each nameserver from one socket) */
struct dns_peer {
	__u64 addr[2]; /* IPv4 (or IPv4-mapped IPv6): its 4 bytes first, the rest 0 */
	__u16 port;    /* host order */
	__u16 v4;      /* addr is an IPv4 address */
	__u16 pad[2];
};

struct dns_peers {
	struct dns_peer p[DNS_PEERS];
	__u32 next; /* the slot a new peer takes, round robin */
	__u32 pad;
};

/* UDP sockets a query went out from, and where to: their answers are taken
 * from those peers only (a datagram from anyone else, or one that is not
 * DNS, is never recorded). An unconnected socket (sendto) says nothing of
 * its peer until a datagram arrives. By inode, not by address: a sock freed
 * and its memory reused for another must not inherit the mark. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64); /* the socket's inode number */
	__type(value, struct dns_peers);
} dns_socks SEC(".maps");

/* A receive on such a socket, from its entry to its return, by thread. */
struct dns_call {
	__u64 sk;
	__u64 ino;
	__u64 buf;		/* the user buffer the datagram lands in */
	__u64 addr;		/* the user sockaddr the kernel writes the peer to, or 0 */
	__u64 task_start;	/* the thread's start_time: a reused thread id is not it */
	struct dns_peer queued; /* UDP, no address asked, not connected: queued_peer at entry */
	long nr;		/* the syscall's number: its return must be the same call's */
	__u32 tcp;		/* a TCP socket (its bytes are a stream) */
	__u32 addr_kernel;	/* addr is kernel memory (the kernel-function programs') */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64); /* pid_tgid */
	__type(value, struct dns_call);
} dns_calls SEC(".maps");

/* Receives between entry and return, node-wide: the return programs run at
 * every read's return and leave on this one load while it is 0. A thread
 * killed inside such a call leaves it counted; the returns then pay a
 * lookup each, nothing else. */
__u32 dns_waiting SEC(".bss.dns");

/* A socket address as user space passes it: sockaddr_in, or sockaddr_in6's
 * first 24 bytes. */
struct user_sockaddr {
	__u16 family;
	__u16 port; /* network order */
	__u32 v4;   /* sockaddr_in: the address; sockaddr_in6: flowinfo */
	__u8 v6[16];
};

static __always_inline bool sock_is_udp(struct sock *sk, const bool btf)
{
	if (btf)
		return sk->sk_type == SOCK_DGRAM && sk->sk_protocol == IPPROTO_UDP;
	return BPF_CORE_READ(sk, sk_type) == SOCK_DGRAM &&
	       BPF_CORE_READ(sk, sk_protocol) == IPPROTO_UDP;
}

/* Does a target ask for the current task's DNS, without looking at its
 * socket: a pid or cgroup target, or a port target on 53 (every process's)? */
static __always_inline bool dns_task_taken(struct nettap_capture_config *cfg)
{
	return task_matches(cfg) ||
	       ((cfg->flags & NETTAP_TARGET_PORT) && port_matches(DNS_PORT, NETTAP_MATCH_CAPTURE));
}

/* The UDP or TCP sock of an fd of the current task when a target asks for
 * its DNS, else NULL; *file: its file, *tcp: whether it is TCP. */
static __always_inline struct sock *dns_fd_sock(unsigned long fd, struct file **file, bool *tcp,
						const bool btf)
{
	struct nettap_capture_config *cfg = active_config();
	struct sock *sk;
	__u64 inode = 0;
	bool taken;

	if (!cfg)
		return NULL;
	taken = dns_task_taken(cfg);
	if (!taken && !(cfg->flags & NETTAP_TARGET_NETNS))
		return NULL;
	*file = fd_to_file(fd, btf);
	sk = file_to_sock(*file, btf, &inode);
	if (!sk || !file_is_socket(*file, inode, btf))
		return NULL;
	*tcp = sock_is_tcp(sk, btf);
	if (!*tcp && !sock_is_udp(sk, btf))
		return NULL;
	if (!taken && !netns_matches(sk, btf, NETTAP_MATCH_CAPTURE))
		return NULL;
	return sk;
}

/* probe dns's counters: calls, every message or piece published (a send,
 * or a receive's return), and its bytes and records; returns, the kept
 * receives' returns. */
static __always_inline void counters_add_returns(__u32 probe)
{
	struct nettap_probe_counters *c = counters(probe);

	if (c)
		__sync_fetch_and_add(&c->returns, 1);
}

static __always_inline __u64 file_ino(struct file *file)
{
	return BPF_CORE_READ(file, f_inode, i_ino);
}

/* A socket address's first size bytes: from user memory (the syscall's
 * argument), or from the kernel's copy (the kernel-function programs'). */
static __always_inline long read_sockaddr(void *dst, __u32 size, __u64 addr, bool kernel)
{
	if (kernel)
		return bpf_probe_read_kernel(dst, size, (void *)addr);
	return bpf_probe_read_user(dst, size, (void *)addr);
}

/* Does a UDP datagram's start look like a DNS message of its direction: a
 * header (RFC 1035 4.1.1) with one question, and QR set on an answer
 * (received) and clear on a query (sent)? User space parses the rest. */
static __always_inline bool dns_header_ok(const __u8 *data, __u64 n, __u8 direction)
{
	if (n < 12 || data[4] != 0 || data[5] != 1)
		return false;
	return !!(data[2] & 0x80) == (direction == NETTAP_DIR_INGRESS);
}

/* An IPv4-mapped IPv6 address (::ffff:a.b.c.d) as the IPv4 address: a
 * dual-stack socket may name its server either way. */
static __always_inline void peer_unmap(struct dns_peer *p)
{
	if (p->addr[0] == 0 && (__u32)p->addr[1] == bpf_htonl(0xffff)) {
		p->addr[0] = p->addr[1] >> 32;
		p->addr[1] = 0;
		p->v4 = 1;
	}
}

/* The peer a socket address names (sendto's, or the one recvfrom wrote;
 * in kernel memory when kernel); false when it names none. *p zeroed. */
static __always_inline bool sockaddr_peer(struct dns_peer *p, __u64 addr, bool kernel)
{
	struct user_sockaddr sa = {};

	if (!addr || read_sockaddr(&sa, 8, addr, kernel))
		return false;
	if (sa.family == AF_INET) {
		p->addr[0] = sa.v4;
		p->v4 = 1;
	} else if (sa.family != AF_INET6 || read_sockaddr(p->addr, 16, addr + 8, kernel)) {
		return false;
	}
	p->port = bpf_ntohs(sa.port);
	peer_unmap(p);
	return true;
}

/* The peer a socket is connected to (port 0: none). *p zeroed. */
static __always_inline void sock_peer(struct dns_peer *p, struct sock *sk)
{
	if (BPF_CORE_READ(sk, __sk_common.skc_family) == AF_INET6) {
		bpf_core_read(p->addr, 16, &sk->__sk_common.skc_v6_daddr);
	} else {
		p->addr[0] = BPF_CORE_READ(sk, __sk_common.skc_daddr);
		p->v4 = 1;
	}
	p->port = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
	peer_unmap(p);
}

/* The sender of the datagram a receive on a UDP socket would read now: the
 * first one queued (reader_queue, else sk_receive_queue, as __skb_recv_udp
 * takes them), from its IP and UDP headers. Port 0 when none is queued. For
 * a receive that asks no sender's address on a socket not connected: read at
 * its entry (a receive that finds nothing queued and waits is not taken). */
static __always_inline void queued_peer(struct dns_peer *p, struct sock *sk)
{
	struct udp_sock *up = (struct udp_sock *)sk;
	struct sk_buff *skb = BPF_CORE_READ(up, reader_queue.next);
	unsigned char *head;
	__u16 nh, th;
	__be16 port = 0;
	__u8 ver = 0;

	if (!skb || (void *)skb == (void *)&up->reader_queue) {
		skb = BPF_CORE_READ(sk, sk_receive_queue.next);
		if (!skb || (void *)skb == (void *)&sk->sk_receive_queue)
			return;
	}
	head = BPF_CORE_READ(skb, head);
	nh = BPF_CORE_READ(skb, network_header);
	th = BPF_CORE_READ(skb, transport_header);
	if (bpf_probe_read_kernel(&ver, 1, head + nh) || bpf_probe_read_kernel(&port, 2, head + th))
		return;
	if (ver >> 4 == 4) { /* struct iphdr: saddr at 12 */
		if (bpf_probe_read_kernel(p->addr, 4, head + nh + 12))
			return;
		p->v4 = 1;
	} else if (ver >> 4 != 6 || bpf_probe_read_kernel(p->addr, 16, head + nh + 8)) {
		return; /* struct ipv6hdr: saddr at 8 */
	}
	p->port = bpf_ntohs(port);
	peer_unmap(p);
}

/* The peer of a UDP send or receive: the address the call names, else the
 * socket's own. */
static __always_inline void udp_peer(struct dns_peer *p, struct sock *sk, __u64 addr, bool kernel)
{
	if (!sockaddr_peer(p, addr, kernel))
		sock_peer(p, sk);
}

static __always_inline bool peer_eq(const struct dns_peer *a, const struct dns_peer *b)
{
	return a->addr[0] == b->addr[0] && a->addr[1] == b->addr[1] && a->port == b->port;
}

/* Remember that socket ino sent a query to p. */
static __always_inline void dns_remember(__u64 ino, const struct dns_peer *p)
{
	struct dns_peers *v = bpf_map_lookup_elem(&dns_socks, &ino);
	struct dns_peers fresh = {};
	__u32 i;

	if (!v) {
		fresh.p[0] = *p;
		fresh.next = 1;
		bpf_map_update_elem(&dns_socks, &ino, &fresh, BPF_ANY);
		return;
	}
	for (i = 0; i < DNS_PEERS; i++)
		if (peer_eq(&v->p[i], p))
			return;
	i = v->next;
	v->p[i & (DNS_PEERS - 1)] = *p;
	v->next = i + 1;
}

/* Did socket ino send a query to p? (Port 0: no peer known, as a free
 * slot.) */
static __always_inline bool dns_peer_known(__u64 ino, const struct dns_peer *p)
{
	struct dns_peers *v;

	if (!p->port)
		return false;
	v = bpf_map_lookup_elem(&dns_socks, &ino);
	if (!v)
		return false;
	for (__u32 i = 0; i < DNS_PEERS; i++)
		if (peer_eq(&v->p[i], p))
			return true;
	return false;
}

/* The record's peer: a queued datagram's sender (queued_peer), as the
 * kernel would tell it to the socket (IPv4-mapped on an IPv6 socket). */
static __always_inline void record_peer(struct nettap_dns *r, const struct dns_peer *p)
{
	r->ports.dport = p->port;
	__builtin_memcpy(r->addrs.daddr, p->addr, sizeof(r->addrs.daddr));
	if (p->v4 && r->ports.family == AF_INET6) {
		__builtin_memset(r->addrs.daddr, 0, 10);
		r->addrs.daddr[10] = r->addrs.daddr[11] = 0xff;
		__builtin_memcpy(&r->addrs.daddr[12], p->addr, 4);
	}
}

/* Publish one message of size bytes at user address buf. peer: the
 * sockaddr naming the other end (sendto's, or what recvfrom wrote; in
 * kernel memory when peer_kernel), or 0 for the socket's own peer, or
 * queued's when it has a port. */
static __always_inline void dns_publish(struct sock *sk, __u64 ino, __u64 buf, __u64 size,
					__u64 peer, bool peer_kernel, __u8 direction, bool tcp,
					const struct dns_peer *queued, const bool btf)
{
	struct nettap_probe_counters *c = counters(NETTAP_PROBE_DNS);
	__u64 id = bpf_get_current_pid_tgid();
	struct user_sockaddr sa = {};
	struct nettap_dns *r;
	__u64 n = size;

	r = bpf_ringbuf_reserve(&dns, sizeof(*r), 0);
	if (!r) {
		if (c) {
			__sync_fetch_and_add(&c->calls, 1);
			__sync_fetch_and_add(&c->bytes, size);
		}
		count_drop(NETTAP_RING_DNS, 1);
		return;
	}
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = 0;
	r->h.kind = NETTAP_KIND_DNS;
	r->h.pid = id >> 32;
	r->sock_ino = ino;
	r->size = size;
	r->tid = (__u32)id;
	r->direction = direction;
	r->flags = 0;
	r->transport = tcp ? NETTAP_TRANSPORT_TCP : NETTAP_TRANSPORT_UDP;
	__builtin_memset(r->pad0, 0, sizeof(r->pad0));
	obs_sock(sk, btf, &r->ports, &r->addrs, &r->netns);
	/* sockaddr_in's 8 bytes first: the user's struct may end there */
	if (peer && !read_sockaddr(&sa, 8, peer, peer_kernel)) {
		if (sa.family == AF_INET) {
			__builtin_memset(r->addrs.daddr, 0, sizeof(r->addrs.daddr));
			*(__u32 *)r->addrs.daddr = sa.v4;
			r->ports.dport = bpf_ntohs(sa.port);
		} else if (sa.family == AF_INET6 &&
			   !read_sockaddr(sa.v6, sizeof(sa.v6), peer + 8, peer_kernel)) {
			__builtin_memcpy(r->addrs.daddr, sa.v6, sizeof(r->addrs.daddr));
			r->ports.dport = bpf_ntohs(sa.port);
		}
	}
	if (queued && queued->port)
		record_peer(r, queued);
	bpf_get_current_comm(r->comm, sizeof(r->comm));
	barrier_var(n);
	if (n > NETTAP_DNS_DATA)
		n = NETTAP_DNS_DATA;
	r->len = n;
	if (bpf_probe_read_user(r->data, n, (void *)buf)) {
		__builtin_memset(r->data, 0, sizeof(r->data));
		r->flags = NETTAP_CHUNK_F_READ_FAILED;
	} else if (!tcp && !dns_header_ok(r->data, n, direction)) {
		bpf_ringbuf_discard(r, BPF_RB_NO_WAKEUP); /* not DNS: never recorded */
		return;
	}
	if (c) {
		__sync_fetch_and_add(&c->calls, 1);
		__sync_fetch_and_add(&c->bytes, size);
		__sync_fetch_and_add(&c->chunks, 1);
	}
	/* The reader is woken once a quarter of the ring is pending, as for
	 * the capture rings (conn.bpf.h), else drains on its poll timer. */
	bpf_ringbuf_submit(r, wakeup_flags(&dns, NETTAP_RING_DNS,
					   bpf_ringbuf_query(&dns, BPF_RB_RING_SIZE) / 4));
}

/* The port of a socket's peer (0: not connected). */
static __always_inline __u16 sock_port(struct sock *sk, const bool btf)
{
	return bpf_ntohs(btf ? sk->__sk_common.skc_dport
			     : BPF_CORE_READ(sk, __sk_common.skc_dport));
}

/* A send of len bytes at buf on fd, to addr (0: the socket's peer). */
static __always_inline int dns_send(unsigned long fd, __u64 buf, __u64 len, __u64 addr,
				    const bool btf)
{
	struct file *file = NULL;
	bool tcp = false;
	struct sock *sk = dns_fd_sock(fd, &file, &tcp, btf);
	struct dns_peer peer = {};
	__u64 ino;

	if (!sk)
		return 0;
	if (tcp) /* a connected TCP socket's peer says where its answers come from */
		peer.port = sock_port(sk, btf);
	else
		udp_peer(&peer, sk, addr, false);
	if (peer.port != DNS_PORT)
		return 0;
	ino = file_ino(file);
	if (!tcp)
		dns_remember(ino, &peer);
	dns_publish(sk, ino, buf, len, tcp ? 0 : addr, false, NETTAP_DIR_EGRESS, tcp, NULL, btf);
	return 0;
}

/* A message's name and first buffer (the rest of its iovecs are not read). */
static __always_inline void msg_first(struct user_msghdr *m, __u64 *name, __u64 *buf, __u64 *len)
{
	struct iovec v = {};
	void *iov = NULL;

	bpf_probe_read_user(name, sizeof(*name), &m->msg_name);
	bpf_probe_read_user(&iov, sizeof(iov), &m->msg_iov);
	if (iov)
		bpf_probe_read_user(&v, sizeof(v), iov);
	*buf = (__u64)v.iov_base;
	*len = v.iov_len;
}

/* Is a receive on this socket (inode ino) one of DNS: a UDP socket that
 * sent a query (its answer's sender is checked at the return), or a TCP
 * socket connected to port 53? */
static __always_inline bool dns_recv_sock(struct sock *sk, __u64 ino, bool tcp, const bool btf)
{
	return tcp ? sock_port(sk, btf) == DNS_PORT : !!bpf_map_lookup_elem(&dns_socks, &ino);
}

/* Keep a DNS receive's entry until its return (dns_recv_return): nr names
 * the call (a syscall's number, or a kernel function's DNS_NR_*), buf its
 * user buffer, addr where the peer's address is written (0: none). */
static __always_inline int dns_keep(long nr, struct sock *sk, __u64 ino, __u64 buf, __u64 addr,
				    bool addr_kernel, bool tcp)
{
	struct dns_call call, *old;
	__u64 id;

	/* set only here: the filtered-out path pays for none of it */
	__builtin_memset(&call, 0, sizeof(call));
	id = bpf_get_current_pid_tgid();
	call.sk = (__u64)sk;
	call.ino = ino;
	call.buf = buf;
	call.addr = addr;
	call.task_start = task_start_time();
	call.nr = nr;
	call.tcp = tcp;
	call.addr_kernel = addr_kernel;
	if (!tcp && !addr && !sock_port(sk, false))
		queued_peer(&call.queued, sk);
	/* An entry left by a call whose return was not seen (the programs
	 * detached meanwhile) is this thread's: replaced, counted once. */
	old = bpf_map_lookup_elem(&dns_calls, &id);
	if (old)
		*old = call;
	else if (!bpf_map_update_elem(&dns_calls, &id, &call, BPF_NOEXIST))
		__sync_fetch_and_add(&dns_waiting, 1);
	return 0;
}

/* A receive's entry on fd: kept when its socket sent a query, or is
 * connected to port 53. */
static __always_inline int dns_recv(long nr, unsigned long fd, __u64 buf, __u64 addr,
				    const bool btf)
{
	struct file *file = NULL;
	bool tcp = false;
	struct sock *sk = dns_fd_sock(fd, &file, &tcp, btf);
	__u64 ino;

	if (!sk)
		return 0;
	ino = file_ino(file);
	if (!dns_recv_sock(sk, ino, tcp, btf))
		return 0;
	return dns_keep(nr, sk, ino, buf, addr, false, tcp);
}

static __always_inline int dns_recv_return(long nr, long ret, const bool btf)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct dns_call *call;
	struct dns_call c;

	if (!dns_waiting)
		return 0;
	call = bpf_map_lookup_elem(&dns_calls, &id);
	if (!call)
		return 0;
	c = *call;
	if (!bpf_map_delete_elem(&dns_calls, &id))
		__sync_fetch_and_add(&dns_waiting, -1);
	if (c.nr != nr || c.task_start != task_start_time())
		return 0;
	counters_add_returns(NETTAP_PROBE_DNS);
	if (ret <= 0)
		return 0;
	if (!c.tcp) { /* from a peer the socket sent a query to, or not taken */
		struct dns_peer peer = {};

		udp_peer(&peer, (struct sock *)c.sk, c.addr, c.addr_kernel);
		if (!peer.port)
			peer = c.queued;
		if (!dns_peer_known(c.ino, &peer))
			return 0;
	}
	dns_publish((struct sock *)c.sk, c.ino, c.buf, ret, c.tcp ? 0 : c.addr, c.addr_kernel,
		    NETTAP_DIR_INGRESS, c.tcp, &c.queued, false);
	return 0;
}

// clang-format off
/* sendto(2): fd, buf, len, flags, addr, addrlen */
NETTAP_TP("tracepoint/syscalls/sys_enter_sendto", dns_sendto, struct trace_event_raw_sys_enter, "probe=dns", {
	return dns_send(ctx->args[0], ctx->args[1], ctx->args[2], ctx->args[4], fast);
})

/* write(2): fd, buf, len (a connected socket: Go's resolver) */
NETTAP_TP("tracepoint/syscalls/sys_enter_write", dns_write, struct trace_event_raw_sys_enter, "probe=dns", {
	return dns_send(ctx->args[0], ctx->args[1], ctx->args[2], 0, fast);
})

/* writev(2): fd, iov, iovcnt: a record an iovec, the first DNS_MMSG (glibc
 * writes a TCP query's length and message as two) */
NETTAP_TP("tracepoint/syscalls/sys_enter_writev", dns_writev, struct trace_event_raw_sys_enter, "probe=dns", {
	__u32 n = ctx->args[2];

	for (int i = 0; i < DNS_MMSG && i < n; i++) {
		struct iovec v = {};

		if (bpf_probe_read_user(&v, sizeof(v), (void *)(ctx->args[1] + i * sizeof(v))))
			break;
		dns_send(ctx->args[0], (__u64)v.iov_base, v.iov_len, 0, fast);
	}
	return 0;
})

/* sendmsg(2): fd, msghdr, flags */
NETTAP_TP("tracepoint/syscalls/sys_enter_sendmsg", dns_sendmsg, struct trace_event_raw_sys_enter, "probe=dns", {
	__u64 name = 0, buf = 0, len = 0;

	msg_first((void *)ctx->args[1], &name, &buf, &len);
	return dns_send(ctx->args[0], buf, len, name, fast);
})

/* sendmmsg(2): fd, mmsghdr array, vlen, flags: its first DNS_MMSG messages */
NETTAP_TP("tracepoint/syscalls/sys_enter_sendmmsg", dns_sendmmsg, struct trace_event_raw_sys_enter, "probe=dns", {
	__u32 vlen = ctx->args[2];

	for (int i = 0; i < DNS_MMSG && i < vlen; i++) {
		__u64 name = 0, buf = 0, len = 0;

		msg_first((void *)(ctx->args[1] + i * MMSGHDR_STRIDE), &name, &buf, &len);
		dns_send(ctx->args[0], buf, len, name, fast);
	}
	return 0;
})

/* recvfrom(2): fd, buf, len, flags, addr, addrlen */
NETTAP_TP("tracepoint/syscalls/sys_enter_recvfrom", dns_recvfrom, struct trace_event_raw_sys_enter, "probe=dns", {
	return dns_recv(ctx->id, ctx->args[0], ctx->args[1], ctx->args[4], fast);
})

/* read(2): fd, buf, len */
NETTAP_TP("tracepoint/syscalls/sys_enter_read", dns_read, struct trace_event_raw_sys_enter, "probe=dns", {
	return dns_recv(ctx->id, ctx->args[0], ctx->args[1], 0, fast);
})

/* recvmsg(2): fd, msghdr, flags */
NETTAP_TP("tracepoint/syscalls/sys_enter_recvmsg", dns_recvmsg, struct trace_event_raw_sys_enter, "probe=dns", {
	__u64 name = 0, buf = 0, len = 0;

	msg_first((void *)ctx->args[1], &name, &buf, &len);
	return dns_recv(ctx->id, ctx->args[0], buf, name, fast);
})

/* Attached by user space to sys_exit_recvfrom, _read and _recvmsg. */
NETTAP_TP("tracepoint/syscalls/sys_exit_recvfrom", dns_recv_exit, struct trace_event_raw_sys_exit, "probe=dns attach=sys_exit_recvfrom,sys_exit_read,sys_exit_recvmsg", {
	return dns_recv_return(ctx->id, ctx->ret, fast);
})
// clang-format on

/*
 * The DNS programs' kernel-function mechanisms (fentry/fexit,
 * else kprobe/kretprobe), on the inet sockets' send and receive:
 * inet_sendmsg and inet6_sendmsg, inet_recvmsg and inet6_recvmsg, which
 * every send and receive call of a UDP or TCP socket goes through (write,
 * sendto, sendmsg, each message of a sendmmsg; read, recvfrom, recvmsg, each
 * of a recvmmsg), and nothing else: a pipe's or a file's read and write
 * never run them, as they run the syscall tracepoints above.
 *
 * The socket is an argument; the user buffers come from the msghdr's
 * iterator (core_fixes.bpf.h), and the peer's address from the kernel's
 * copy of it (msg_name). A receive is kept at its entry and published at its
 * return, as the tracepoints' are (dns_keep, dns_recv_return). `fast` as in
 * filter.bpf.h: the socket's fields by direct loads (Linux 6.2+), else
 * through bpf_probe_read_kernel.
 */

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
