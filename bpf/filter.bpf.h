/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * filter.bpf.h: does this call concern a capture target? Runs first in
 * every entry program and leaves early: a call that matches no target
 * touches no counter.
 *
 * Every function takes `btf`, a compile-time constant: true in the "fast"
 * programs (Linux 6.2+: BTF pointers read by direct loads, which the
 * verifier turns into exception-handled loads), false in the "compat"
 * programs (Linux 5.8+: bpf_probe_read_kernel through BPF_CORE_READ). The
 * functions are always inlined, so each program carries one branch only.
 */
#ifndef NETTAP_FILTER_BPF_H
#define NETTAP_FILTER_BPF_H

#include "conn.bpf.h"

#define S_IFMT	 00170000
#define S_IFSOCK 0140000

static __always_inline struct nettap_capture_config *active_config(void)
{
	__u32 zero = 0;
	struct nettap_capture_config *cfg = bpf_map_lookup_elem(&capture_config, &zero);

	if (!cfg || !cfg->flags)
		return NULL;
	return cfg;
}

/* Does the config ask for records of this kind (capture.records, with every
 * target's records:)? kind is a constant at every call. */
static __always_inline bool kind_wanted(const struct nettap_capture_config *cfg, const __u32 kind)
{
	return cfg && (cfg->records & (1U << kind));
}

/* Does this connection's record of this kind go out? What its targets ask
 * (conn.wants, decided with its capture), else what the config asks. */
static __always_inline bool conn_wants(const struct nettap_capture_config *cfg,
				       const struct conn *cn, const __u32 kind)
{
	if (cn && cn->wants)
		return cn->wants & (1U << kind);
	return kind_wanted(cfg, kind);
}

/* Index of a single set bit: debruijn32[(bit * 0x077CB531) >> 27]. */
// clang-format off
NETTAP_SHARED const __u8 debruijn32[32] NETTAP_INIT({
	0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8,
	31, 27, 13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9,
});
// clang-format on

/* A target map's entry found: the call's target. Its value (NETTAP_MATCH_*)
 * says what the target asks, read where a connection is decided
 * (target_kinds); want is NETTAP_MATCH_CAPTURE at every call. */
static __always_inline bool match(const void *v, const __u32 want)
{
	return v && (want == NETTAP_MATCH_CAPTURE || (*(const __u32 *)v & want));
}

/* The task-level targets (pid, cgroup): the OR of the values of those that
 * name the current task (0: none). first: stop at the first (the filter's
 * question: is it captured?); else every one (what do they ask?). */
static __always_inline __u32 task_targets(struct nettap_capture_config *cfg, const bool first)
{
	__u32 out = 0, *v;

	if (cfg->flags & NETTAP_TARGET_PID) {
		__u32 tgid = bpf_get_current_pid_tgid() >> 32;
		__u32 word = (tgid >> 6) & 1023;
		__u64 *bits = bpf_map_lookup_elem(&capture_pid_bits, &word);

		if (bits && (*bits & (1ULL << (tgid & 63)))) {
			v = bpf_map_lookup_elem(&capture_pids, &tgid);
			if (v) {
				out |= *v;
				if (first)
					return out;
			}
		}
	}
	if (cfg->flags & NETTAP_TARGET_CGROUP) {
		__u32 levels = cfg->cgroup_levels;

		/* Containers nest: match the target's level of the current
		 * task's ancestry, one lookup per level a target sits at (user
		 * space allows at most NETTAP_MAX_CGROUP_LEVELS of them). Each
		 * step takes the lowest set bit and finds its index by a de
		 * Bruijn multiply, so the verifier walks 4 steps, not 32. */
		for (int i = 0; i < NETTAP_MAX_CGROUP_LEVELS && levels; i++) {
			__u32 low = levels & -levels;
			__u32 lvl = debruijn32[((low * 0x077CB531U) >> 27) & 31];
			__u64 cg = current_ancestor_cgroup_id(lvl);

			levels &= levels - 1;
			v = cg ? bpf_map_lookup_elem(&capture_cgroups, &cg) : NULL;
			if (v) {
				out |= *v;
				if (first)
					return out;
			}
		}
	}
	return out;
}

static __always_inline bool task_matches(struct nettap_capture_config *cfg)
{
	return task_targets(cfg, true) != 0;
}

/* capture_ports: the captured ports. */
static __always_inline bool port_matches(__u16 port, const __u32 want)
{
	__u32 word = port >> 6;
	__u64 *bits = bpf_map_lookup_elem(&capture_ports, &word);

	return bits && (*bits & (1ULL << (port & 63)));
}

static __always_inline __u32 netns_inum(struct sock *sk, const bool btf)
{
	return btf ? sk->__sk_common.skc_net.net->ns.inum
		   : BPF_CORE_READ(sk, __sk_common.skc_net.net, ns.inum);
}

/* Is this socket's network namespace a target? */
static __always_inline bool netns_matches(struct sock *sk, const bool btf, const __u32 want)
{
	__u32 inum = netns_inum(sk, btf);

	return match(bpf_map_lookup_elem(&capture_netns, &inum), want);
}

/* A socket's ports: the local one, and the remote one in network order. */
struct port_pair {
	__be16 dport;
	__u16 sport;
};

static __always_inline struct port_pair sock_ports(struct sock *sk, const bool btf)
{
	struct port_pair p = {};

	if (btf) {
		p.sport = sk->__sk_common.skc_num;
		p.dport = sk->__sk_common.skc_dport;
	} else if (bpf_core_field_offset(struct sock_common, skc_num) ==
		   bpf_core_field_offset(struct sock_common, skc_dport) + 2) {
		/* the port pair (skc_portpair): one read */
		bpf_probe_read_kernel(&p, sizeof(p),
				      (void *)sk +
					      bpf_core_field_offset(struct sock_common, skc_dport));
	} else {
		p.sport = BPF_CORE_READ(sk, __sk_common.skc_num);
		p.dport = BPF_CORE_READ(sk, __sk_common.skc_dport);
	}
	return p;
}

/* The socket-level targets (netns, port): does this socket match one? */
static __always_inline bool sock_matches(struct nettap_capture_config *cfg, struct sock *sk,
					 const bool btf)
{
	if ((cfg->flags & NETTAP_TARGET_NETNS) && netns_matches(sk, btf, NETTAP_MATCH_CAPTURE))
		return true;
	if (cfg->flags & NETTAP_TARGET_PORT) {
		struct port_pair p = sock_ports(sk, btf);

		if (port_matches(p.sport, NETTAP_MATCH_CAPTURE) ||
		    port_matches(bpf_ntohs(p.dport), NETTAP_MATCH_CAPTURE))
			return true;
	}
	return false;
}

/* The record kinds the targets matching a captured socket ask for (bit
 * 1 << NETTAP_KIND_*), the OR of their entries: for conn.wants, once a
 * connection. task: in its owner's task, where the task targets apply too. */
static __always_inline __u32 target_kinds(const struct sock *sk, const bool btf, const bool task)
{
	struct nettap_capture_config *cfg = active_config();
	__u32 out = 0, key, *v;

	if (!cfg)
		return 0;
	if (task)
		out = task_targets(cfg, false);
	if (cfg->flags & NETTAP_TARGET_NETNS) {
		key = netns_inum((struct sock *)sk, btf);
		v = bpf_map_lookup_elem(&capture_netns, &key);
		if (v)
			out |= *v;
	}
	if (cfg->flags & NETTAP_TARGET_PORT) {
		struct port_pair p = sock_ports((struct sock *)sk, btf);

		key = p.sport;
		v = bpf_map_lookup_elem(&capture_port_kinds, &key);
		if (v)
			out |= *v;
		key = bpf_ntohs(p.dport);
		v = bpf_map_lookup_elem(&capture_port_kinds, &key);
		if (v)
			out |= *v;
	}
	return out & ~NETTAP_MATCH_CAPTURE;
}

static __always_inline bool sock_is_tcp(struct sock *sk, const bool btf)
{
	if (btf)
		return sk->sk_type == SOCK_STREAM && sk->sk_protocol == IPPROTO_TCP;
	if (bpf_core_field_offset(struct sock, sk_protocol) ==
	    bpf_core_field_offset(struct sock, sk_type) + 2) {
		/* two __u16 side by side (Linux 5.6+): one read */
		struct {
			__u16 type;
			__u16 protocol;
		} t = {};

		bpf_probe_read_kernel(&t, sizeof(t),
				      (void *)sk + bpf_core_field_offset(struct sock, sk_type));
		return t.type == SOCK_STREAM && t.protocol == IPPROTO_TCP;
	}
	return BPF_CORE_READ(sk, sk_type) == SOCK_STREAM &&
	       BPF_CORE_READ(sk, sk_protocol) == IPPROTO_TCP;
}

/*
 * fd of the current task -> its socket's sock, or NULL. A file is taken
 * for a socket when its inode sits where a socket's does, right after the
 * struct socket its private_data names (every socket file is made so, by
 * sock_alloc_file): a test on two fields of the file, where reading the
 * inode's mode costs a cache line the send path never touches. It is a
 * test, not a proof: file_is_socket() confirms the mode before a call is
 * kept (captured_fd_sock), and anything read before that goes through
 * exception-handled loads or bpf_probe_read_kernel.
 *
 * With btf, BTF pointers and no helper call: the fd array is indexed by a
 * variable, which direct loads cannot do, so its slot is read as element 0
 * of a files_struct.fd_array cast at that address (bpf_rdonly_cast: an
 * exception-handled load, where bpf_probe_read_kernel cost a helper call).
 */
static __always_inline struct file *fd_to_file(unsigned long fd, const bool btf)
{
	struct file *file = NULL;
	struct file **fds;

	if (btf) {
		struct task_struct *task =
			UNTRUSTED(struct task_struct, bpf_get_current_task_btf());
		struct fdtable *fdt = task->files->fdt;
		struct files_struct *slot;

		if (!fdt || fd >= fdt->max_fds)
			return NULL;
		fds = fdt->fd;
		slot = KCAST(struct files_struct,
			     (void *)&fds[fd] -
				     bpf_core_field_offset(struct files_struct, fd_array));
		return slot->fd_array[0];
	} else {
		struct fdtable *fdt;

		if (nettap_kernel.has_task_btf) {
			/* 5.11+: the task's fd table by direct loads (what the
			 * verifier cannot follow is the array indexed by fd). */
			struct task_struct *task = bpf_get_current_task_btf();

			fdt = task->files->fdt;
			if (!fdt || fd >= fdt->max_fds)
				return NULL;
			fds = fdt->fd;
		} else {
			struct task_struct *task = (void *)bpf_get_current_task();
			struct {
				__u32 max_fds;
				__u32 pad;
				__u64 fd;
			} head = {};

			fdt = BPF_CORE_READ(task, files, fdt);
			if (!fdt)
				return NULL;
			/* max_fds and fd side by side (every kernel so far): one read. */
			if (bpf_core_field_offset(struct fdtable, fd) ==
			    bpf_core_field_offset(struct fdtable, max_fds) + 8) {
				bpf_probe_read_kernel(&head, sizeof(head),
						      (void *)fdt +
							      bpf_core_field_offset(struct fdtable,
										    max_fds));
			} else {
				head.max_fds = BPF_CORE_READ(fdt, max_fds);
				head.fd = (__u64)BPF_CORE_READ(fdt, fd);
			}
			if (fd >= head.max_fds)
				return NULL;
			fds = (struct file **)head.fd;
		}
		if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]))
			return NULL;
		return file;
	}
}

static __always_inline struct sock *file_to_sock(struct file *file, const bool btf,
						 __u64 *file_inode)
{
	__u64 sock, inode;

	if (!file)
		return NULL;
	if (btf) {
		sock = (__u64)file->private_data;
		inode = (__u64)file->f_inode;
	} else {
		sock = (__u64)BPF_CORE_READ(file, private_data);
		inode = (__u64)BPF_CORE_READ(file, f_inode);
	}
	if (!sock || inode != sock + bpf_core_field_offset(struct socket_alloc, vfs_inode))
		return NULL;
	*file_inode = inode;
	if (btf)
		return KCAST(struct socket, sock)->sk;
	return BPF_CORE_READ((struct socket *)sock, sk);
}

/* The proof behind file_to_sock's test: the mode of the inode it read. */
static __always_inline bool file_is_socket(struct file *file, __u64 inode, const bool btf)
{
	umode_t mode = btf ? file->f_inode->i_mode : BPF_CORE_READ((struct inode *)inode, i_mode);

	return (mode & S_IFMT) == S_IFSOCK;
}

/* capture.sample_connections: is this socket's connection one of the 1 in N
 * kept? A hash of its two ends, (address, port) each, taken in order, so that
 * a connection's client socket and server socket decide alike, on one host or
 * on two (unless a NAT between them rewrites an end). An address is its 4
 * bytes as the CPU loads them; an IPv6 one the XOR of its four words, an
 * IPv4-mapped one (::ffff:a.b.c.d) its IPv4 address, so that a dual-stack
 * server agrees with its IPv4 client. The same in Python:
 * exporter/capture/sampling.py (the tests' oracle). */
static __always_inline __u32 addr_word(const __u8 *addr, __u16 family)
{
	const __u32 *w = (const __u32 *)addr;

	if (family != AF_INET6)
		return w[0];
	if (!w[0] && !w[1] && w[2] == bpf_htonl(0xffff))
		return w[3];
	return w[0] ^ w[1] ^ w[2] ^ w[3];
}

static __always_inline bool sample_keep(const struct nettap_capture_config *cfg, struct sock *sk,
					const bool btf)
{
	struct nettap_ports p;
	struct nettap_addrs a;
	__u64 x, y, h;

	if (!cfg->sample_threshold)
		return true;
	read_addrs(sk, btf, &p, &a);
	x = (__u64)addr_word(a.saddr, p.family) << 16 | p.sport;
	y = (__u64)addr_word(a.daddr, p.family) << 16 | p.dport;
	h = (x < y ? x : y) * 0x9E3779B97F4A7C15ULL ^ (x < y ? y : x) * 0xC2B2AE3D27D4EB4FULL;
	h ^= h >> 29;
	return (__u32)(h >> 32) < cfg->sample_threshold;
}

/* The TCP sock of an fd of the current task when a target matches the call,
 * else NULL: the cheapest test first. A task target decides without the
 * socket's ports; a socket target is tested on the ports (or netns) of
 * whatever socket the fd holds (every sock starts with sock_common), and
 * only a match pays for the TCP test. Sampling aside (captured_fd_sock). */
static __always_inline struct sock *matched_fd_sock(struct nettap_capture_config *cfg,
						    unsigned long fd, const bool btf)
{
	struct file *file;
	struct sock *sk;
	__u64 inode = 0;

	if (task_matches(cfg)) {
		file = fd_to_file(fd, btf);
		sk = file_to_sock(file, btf, &inode);
	} else {
		if (!(cfg->flags & (NETTAP_TARGET_NETNS | NETTAP_TARGET_PORT)))
			return NULL;
		file = fd_to_file(fd, btf);
		sk = file_to_sock(file, btf, &inode);
		if (!sk || !sock_matches(cfg, sk, btf))
			return NULL;
	}
	if (!sk || !file_is_socket(file, inode, btf) || !sock_is_tcp(sk, btf))
		return NULL;
	return sk;
}

/* The TCP sock of an fd of the current task when the call is captured: a
 * target matches and its connection is sampled in. */
static __always_inline struct sock *captured_fd_sock(struct nettap_capture_config *cfg,
						     unsigned long fd, const bool btf)
{
	struct sock *sk = matched_fd_sock(cfg, fd, btf);

	return sk && sample_keep(cfg, sk, btf) ? sk : NULL;
}

#endif /* NETTAP_FILTER_BPF_H */
