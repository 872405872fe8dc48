/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * entry_tp.bpf.h: the syscall-tracepoint mechanism. The syscall's own
 * arguments give the fd and the user buffers; the socket is found from the
 * fd. Each program exists twice, NAME (fast) and NAME_compat (see emit.bpf.h);
 * exporter/kernel/loader.py attaches one program to several tracepoints.
 */
#ifndef NETTAP_ENTRY_TP_BPF_H
#define NETTAP_ENTRY_TP_BPF_H

#include "emit.bpf.h"

/* Syscall entry: the filter, cheapest test first. msg: args[1] is a user
 * struct user_msghdr, read only once the call is known to be captured. */
static __always_inline int enter_call(__u32 probe, unsigned long fd, __u64 buf, __u32 iovcnt,
				      const bool msg, const bool fast)
{
	struct nettap_capture_config *cfg = active_config();
	struct call_data d = {};
	struct sock *sk;

	if (!cfg)
		return 0;
	sk = captured_fd_sock(cfg, fd, fast);
	if (!sk)
		return 0;
	d.buf = buf;
	d.iovcnt = iovcnt;
	if (msg) {
		struct user_msghdr *umsg = (void *)buf;
		__u64 n = 0;

		d.buf = 0;
		bpf_probe_read_user(&d.buf, sizeof(d.buf), &umsg->msg_iov);
		bpf_probe_read_user(&n, sizeof(n), &umsg->msg_iovlen);
		d.iovcnt = n ? (__u32)n : 1;
	}
	return enter_sock(probe, sk, &d, fast);
}

/* One tracepoint program in both variants, tagged (NETTAP_PROG) with tag and
 * mech=tracepoint (the body may hold commas). */
// clang-format off
#define NETTAP_TP(sec, name, ctx_type, tag, ...)				\
	static __always_inline int name##_body(ctx_type *ctx, const bool fast)	\
	__VA_ARGS__								\
	NETTAP_PROG(tag " mech=tracepoint variant=fast")			\
	SEC(sec) int name(ctx_type *ctx) { return name##_body(ctx, FAST); }	\
	NETTAP_PROG(tag " mech=tracepoint variant=compat")			\
	SEC(sec) int name##_compat(ctx_type *ctx) { return name##_body(ctx, COMPAT); }

// clang-format on

#endif /* NETTAP_ENTRY_TP_BPF_H */
