/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * core_fixes.bpf.h: every kernel-version difference the programs meet, one
 * block per kernel change, citing the commit. Nothing else in bpf/ tests a
 * kernel version; user space (exporter/kernel/features.py) decides which program
 * variant loads.
 */
#ifndef NETTAP_CORE_FIXES_BPF_H
#define NETTAP_CORE_FIXES_BPF_H

#include "vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "tcp.h"
#include "shared.bpf.h"

/*
 * bpf_rdonly_cast(), Linux 6.2 (commit a35b9af4ec2c "bpf: Add a kfunc for
 * generic type cast"): turns a plain kernel address
 * into a BTF pointer, so the "fast" programs walk task/file/sock with direct
 * loads (exception-handled: a bad address reads 0) instead of a helper call
 * per field. Weak: on older kernels libbpf leaves it unresolved and user
 * space keeps every program that calls it from loading.
 */
#ifdef NETTAP_KSYM_OWNER
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;
#else
/*
 * ... declared __ksym in one linked unit only (calls.bpf.c, built with
 * -DNETTAP_KSYM_OWNER and linked before the other families), a plain extern
 * in the others: libbpf's linker before 1.4.7 and 1.5.0 (libbpf commit
 * ecf998e "libbpf: Do not resolve size on duplicate FUNCs", kernel 4b146e)
 * fails on an extern kfunc's second declaration ("failed to resolve size of
 * underlying type"), and this host's bpftool 7.1 links with libbpf 1.1. The
 * linker merges the plain extern into the __ksym one: the linked object calls
 * one weak kfunc, as before.
 */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __weak;
#endif
#define KCAST(type, ptr) ((type *)bpf_rdonly_cast((void *)(ptr), bpf_core_type_id_kernel(type)))

/*
 * A trusted BTF pointer (bpf_get_current_task_btf()'s task, a tp_btf
 * program's arguments) made untrusted, for the verifier's sake alone. Since
 * Linux 6.3 (commit 57539b1c0ac2 "bpf: Enable annotating trusted nested
 * pointers") each load of a pointer field through a trusted pointer asks
 * whether the field passes trust on (btf_nested_type_is_trusted): up to four
 * lookups by name, each a scan of the whole vmlinux BTF. On 6.18 that made
 * the six syscall entry programs take ~5 ms each to verify and tcp_state
 * 18 ms. Loads through an untrusted pointer are the same exception-handled
 * loads at run time, and the verifier inlines bpf_rdonly_cast (a register
 * move). Fast programs only (6.2+).
 */
#define UNTRUSTED(type, ptr) KCAST(type, ptr)

/*
 * struct iov_iter before Linux 5.14 (commit 8cd54c1c8480 "iov_iter: separate
 * direction from flavour"): one `type` word held the flavour as a bit
 * (ITER_IOVEC 4, ITER_KVEC 8, ITER_BVEC 16, ...) or-ed with the direction
 * (READ 0 / WRITE 1). There was no ITER_UBUF.
 */
struct iov_iter___old {
	unsigned int type;
} __attribute__((preserve_access_index));

#define OLD_ITER_IOVEC 4

/*
 * Linux 6.4 (commit de4f5fed3f23 "iov_iter: add iter_iovec() helper")
 * renamed iov_iter::iov to __iov.
 */
struct iov_iter___new {
	const struct iovec *__iov;
} __attribute__((preserve_access_index));

/* What a kernel-function probe can read of a call's data iterator. */
enum nettap_iter {
	NETTAP_ITER_UBUF,  /* one user buffer: ubuf */
	NETTAP_ITER_IOVEC, /* user buffers: a kernel array of struct iovec */
	NETTAP_ITER_OTHER, /* kernel pages or buffers: no user payload */
};

/* The flavour of msg->msg_iter, and the kernel's own number for it (logged
 * when the payload cannot be read). msg may be a BTF or a plain pointer. */
static __always_inline enum nettap_iter iter_kind(struct msghdr *msg, __u32 *raw)
{
	if (bpf_core_field_exists(msg->msg_iter.iter_type)) {
		__u8 t = BPF_CORE_READ(msg, msg_iter.iter_type);

		*raw = t;
		/* ITER_UBUF: Linux 6.0 (commit fcb14cb1bdac "new iov_iter flavour -
		 * ITER_UBUF"): read/write build it since 6.0, send/recv since 6.4. */
		if (bpf_core_enum_value_exists(enum iter_type, ITER_UBUF) &&
		    t == bpf_core_enum_value(enum iter_type, ITER_UBUF))
			return NETTAP_ITER_UBUF;
		if (t == bpf_core_enum_value(enum iter_type, ITER_IOVEC))
			return NETTAP_ITER_IOVEC;
		return NETTAP_ITER_OTHER;
	} else {
		struct iov_iter___old *it = (void *)&msg->msg_iter;
		unsigned int t = BPF_CORE_READ(it, type);

		*raw = t;
		return (t & ~1U) == OLD_ITER_IOVEC ? NETTAP_ITER_IOVEC : NETTAP_ITER_OTHER;
	}
}

/* The kernel address of the iterator's struct iovec array (ITER_IOVEC). */
static __always_inline __u64 iter_iovec(struct msghdr *msg)
{
	struct iov_iter___new *it = (void *)&msg->msg_iter;

	if (bpf_core_field_exists(it->__iov))
		return (__u64)BPF_CORE_READ(it, __iov);
	return (__u64)BPF_CORE_READ(msg, msg_iter.iov);
}

/*
 * bpf_get_current_ancestor_cgroup_id() is offered to tracing programs only
 * since Linux 5.14 (commit 95b861a7935b "bpf: Allow bpf_get_current_ancestor_cgroup_id
 * for tracing"). Where it is missing, the compat programs read the ancestry
 * from struct cgroup itself: ancestor_ids[] up to 6.0, ancestors[] since 6.1
 * (commit 7f203bc89eb6 "cgroup: Replace cgroup->ancestor_ids[] with
 * ->ancestors[]"; tests force that path on every kernel). User space sets nettap_kernel.has_ancestor_cgroup_id
 * from the helper probe; the verifier knows the value (frozen .rodata) and never
 * visits the branch not taken, so the helper call is not seen where it is unknown.
 */
struct kernfs_node {
	__u64 id;
} __attribute__((preserve_access_index));

struct cgroup___old {
	int level;
	__u64 ancestor_ids[];
} __attribute__((preserve_access_index));

struct cgroup___new {
	int level;
	struct kernfs_node *kn;
	struct cgroup___new *ancestors[];
} __attribute__((preserve_access_index));

NETTAP_SHARED const volatile struct nettap_kernel nettap_kernel SEC(".rodata.nettap") NETTAP_INIT({
	.has_ancestor_cgroup_id = 1,
	.has_task_btf = 1,
	.has_bpf_loop = 1,
	.keep_inflight = 1,
});

static __always_inline __u64 current_ancestor_cgroup_id(__u32 level)
{
	struct cgroup___old *old = NULL;
	struct cgroup___new *new = NULL;
	struct task_struct *task;
	void *cg;
	__u64 id = 0;

	if (nettap_kernel.has_ancestor_cgroup_id)
		return bpf_get_current_ancestor_cgroup_id(level);
	task = (void *)bpf_get_current_task();
	cg = BPF_CORE_READ(task, cgroups, dfl_cgrp);
	old = cg;
	if (!cg || level > (__u32)BPF_CORE_READ(old, level))
		return 0;
	level &= 31;
	if (bpf_core_field_exists(old->ancestor_ids)) {
		bpf_probe_read_kernel(&id, sizeof(id),
				      cg + bpf_core_field_offset(old->ancestor_ids) +
					      level * sizeof(__u64));
	} else if (bpf_core_field_exists(new->ancestors)) {
		bpf_probe_read_kernel(&new, sizeof(new),
				      cg + bpf_core_field_offset(new->ancestors) +
					      level * sizeof(void *));
		id = BPF_CORE_READ(new, kn, id);
	}
	return id;
}

/*
 * A TCP socket's keepalive timer: sk->sk_timer, or, where the kernel has
 * inet_connection_sock::icsk_keepalive_timer (upstream net-next, Nov 2025:
 * "tcp: introduce icsk->icsk_keepalive_timer", in a union with
 * mptcp_tout_timer; also in Debian's 6.1.0-57 and 6.12.118 stable kernels,
 * not in 5.10.0-46 nor this host's 6.18), that member. tcp_keepalive_timer
 * then arms and runs icsk_keepalive_timer and sk_timer is no TCP timer at
 * all: the 6.12 guest's keepalive fired at sk + 1184 (icsk_keepalive_timer),
 * sk_timer is at sk + 448. The socket is the icsk's first member (offset 0).
 */
struct inet_connection_sock___ka {
	struct timer_list icsk_keepalive_timer;
} __attribute__((preserve_access_index));

/* The offset of a TCP socket's keepalive timer in its socket. */
static __always_inline __u64 keepalive_timer_offset(void)
{
	if (bpf_core_field_exists(struct inet_connection_sock___ka, icsk_keepalive_timer))
		return bpf_core_field_offset(struct inet_connection_sock___ka,
					     icsk_keepalive_timer);
	return bpf_core_field_offset(struct sock, sk_timer);
}

#endif /* NETTAP_CORE_FIXES_BPF_H */
