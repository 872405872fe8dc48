/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * entry_func.bpf.h: the kernel-function mechanisms, fentry/fexit (BTF
 * trampolines, Linux 5.5; fexit's bpf_get_func_ret, 5.17) and
 * kprobe/kretprobe. The socket is an argument (no fd walk); the user buffers
 * come from the msghdr's iterator, as the syscall built it: one user buffer
 * (ITER_UBUF: read/write since 6.0, send/recv since 6.4) or an array of user
 * iovecs (ITER_IOVEC: readv/writev, sendmsg/recvmsg, and single buffers on
 * older kernels). Other iterators hold kernel pages (sendfile,
 * splice): their bytes are counted and logged, never published as chunks.
 */
#ifndef NETTAP_ENTRY_FUNC_BPF_H
#define NETTAP_ENTRY_FUNC_BPF_H

#include <bpf/bpf_tracing.h>
#include "emit.bpf.h"

/* btf_sk: sk is a BTF pointer (fentry's typed argument, or KCAST), read by
 * direct loads; otherwise by bpf_probe_read_kernel. The fast fentry program
 * passes its argument untrusted, as tcp_state does (core_fixes.bpf.h). */
static __always_inline int enter_func(__u32 probe, struct sock *sk, struct msghdr *msg,
				      const bool btf_sk, const bool fast)
{
	struct nettap_capture_config *cfg = active_config();
	struct call_data d = {};
	__u32 raw = 0;

	if (!cfg || !sk)
		return 0;
	if ((!task_matches(cfg) && !sock_matches(cfg, sk, btf_sk)) ||
	    !sample_keep(cfg, sk, btf_sk)) {
		inflight_forget(fast);
		return 0;
	}
	switch (iter_kind(msg, &raw)) {
	case NETTAP_ITER_UBUF:
		d.buf = (__u64)BPF_CORE_READ(msg, msg_iter.ubuf) +
			BPF_CORE_READ(msg, msg_iter.iov_offset);
		break;
	case NETTAP_ITER_IOVEC:
		d.buf = iter_iovec(msg);
		d.iovcnt = BPF_CORE_READ(msg, msg_iter.nr_segs);
		d.iovcnt = d.iovcnt ? d.iovcnt : 1;
		d.skip = BPF_CORE_READ(msg, msg_iter.iov_offset);
		d.iov_kernel = 1;
		break;
	default:
		d.unreadable = 1;
		d.iter_type = raw;
	}
	return enter_sock(probe, sk, &d, fast);
}

/* fexit: bpf_get_func_ret finds the return value wherever the arguments
 * end (tcp_recvmsg lost its nonblock argument in Linux 5.19). */
static __always_inline long func_ret(void *ctx)
{
	__u64 ret = 0;

	bpf_get_func_ret(ctx, &ret);
	return (int)ret;
}

#define NETTAP_FENTRY(func, probe)                                                     \
	NETTAP_PROG("probe=" #func " mech=fentry variant=fast")                        \
	SEC("fentry/" #func)                                                           \
	int BPF_PROG(func##_fentry, struct sock *sk, struct msghdr *msg)               \
	{                                                                              \
		return enter_func(probe, UNTRUSTED(struct sock, sk), msg, true, FAST); \
	}                                                                              \
	NETTAP_PROG("probe=" #func " mech=fentry variant=compat")                      \
	SEC("fentry/" #func)                                                           \
	int BPF_PROG(func##_fentry_compat, struct sock *sk, struct msghdr *msg)        \
	{                                                                              \
		return enter_func(probe, sk, msg, true, COMPAT);                       \
	}                                                                              \
	NETTAP_PROG("probe=" #func " mech=fentry variant=fast")                        \
	SEC("fexit/" #func)                                                            \
	int func##_fexit(void *ctx)                                                    \
	{                                                                              \
		return exit_call(probe, func_ret(ctx), FAST);                          \
	}                                                                              \
	NETTAP_PROG("probe=" #func " mech=fentry variant=compat")                      \
	SEC("fexit/" #func)                                                            \
	int func##_fexit_compat(void *ctx)                                             \
	{                                                                              \
		return exit_call(probe, func_ret(ctx), COMPAT);                        \
	}

#define NETTAP_KPROBE(func, probe)                                                 \
	NETTAP_PROG("probe=" #func " mech=kprobe variant=fast")                    \
	SEC("kprobe/" #func)                                                       \
	int BPF_KPROBE(func##_kprobe, struct sock *sk, struct msghdr *msg)         \
	{                                                                          \
		return enter_func(probe, KCAST(struct sock, sk), msg, true, FAST); \
	}                                                                          \
	NETTAP_PROG("probe=" #func " mech=kprobe variant=compat")                  \
	SEC("kprobe/" #func)                                                       \
	int BPF_KPROBE(func##_kprobe_compat, struct sock *sk, struct msghdr *msg)  \
	{                                                                          \
		return enter_func(probe, sk, msg, false, COMPAT);                  \
	}                                                                          \
	NETTAP_PROG("probe=" #func " mech=kprobe variant=fast")                    \
	SEC("kretprobe/" #func)                                                    \
	int BPF_KRETPROBE(func##_kretprobe, int ret)                               \
	{                                                                          \
		return exit_call(probe, ret, FAST);                                \
	}                                                                          \
	NETTAP_PROG("probe=" #func " mech=kprobe variant=compat")                  \
	SEC("kretprobe/" #func)                                                    \
	int BPF_KRETPROBE(func##_kretprobe_compat, int ret)                        \
	{                                                                          \
		return exit_call(probe, ret, COMPAT);                              \
	}

#endif /* NETTAP_ENTRY_FUNC_BPF_H */
