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

/* write(2), sendto(2): args fd, buf, len */
NETTAP_TP("tracepoint/syscalls/sys_enter_write", tcp_sendmsg_enter, struct trace_event_raw_sys_enter,
	  "probe=tcp_sendmsg attach=sys_enter_write,sys_enter_sendto", {
	return enter_call(NETTAP_PROBE_TCP_SENDMSG, ctx->args[0], ctx->args[1], 0, false, fast);
})

/* writev(2): args fd, iov, iovcnt */
NETTAP_TP("tracepoint/syscalls/sys_enter_writev", tcp_sendmsg_enter_iov, struct trace_event_raw_sys_enter,
	  "probe=tcp_sendmsg", {
	__u32 n = ctx->args[2];

	return enter_call(NETTAP_PROBE_TCP_SENDMSG, ctx->args[0], ctx->args[1], n ? n : 1, false, fast);
})

/* sendmsg(2): args fd, msghdr, flags */
NETTAP_TP("tracepoint/syscalls/sys_enter_sendmsg", tcp_sendmsg_enter_msg, struct trace_event_raw_sys_enter,
	  "probe=tcp_sendmsg", {
	return enter_call(NETTAP_PROBE_TCP_SENDMSG, ctx->args[0], ctx->args[1], 0, true, fast);
})

/* read(2), recvfrom(2): args fd, buf, len */
NETTAP_TP("tracepoint/syscalls/sys_enter_read", tcp_recvmsg_enter, struct trace_event_raw_sys_enter,
	  "probe=tcp_recvmsg attach=sys_enter_read,sys_enter_recvfrom", {
	return enter_call(NETTAP_PROBE_TCP_RECVMSG, ctx->args[0], ctx->args[1], 0, false, fast);
})

/* readv(2): args fd, iov, iovcnt */
NETTAP_TP("tracepoint/syscalls/sys_enter_readv", tcp_recvmsg_enter_iov, struct trace_event_raw_sys_enter,
	  "probe=tcp_recvmsg", {
	__u32 n = ctx->args[2];

	return enter_call(NETTAP_PROBE_TCP_RECVMSG, ctx->args[0], ctx->args[1], n ? n : 1, false, fast);
})

/* recvmsg(2): args fd, msghdr, flags */
NETTAP_TP("tracepoint/syscalls/sys_enter_recvmsg", tcp_recvmsg_enter_msg, struct trace_event_raw_sys_enter,
	  "probe=tcp_recvmsg", {
	return enter_call(NETTAP_PROBE_TCP_RECVMSG, ctx->args[0], ctx->args[1], 0, true, fast);
})

/* Attached by user space to sys_exit_write, _sendto, _writev, _sendmsg
 * (and the receive side's four): one program, several tracepoints. */
NETTAP_TP("tracepoint/syscalls/sys_exit_write", tcp_sendmsg_exit, struct trace_event_raw_sys_exit,
	  "probe=tcp_sendmsg attach=sys_exit_write,sys_exit_sendto,sys_exit_writev,sys_exit_sendmsg", {
	return exit_call(NETTAP_PROBE_TCP_SENDMSG, ctx->ret, fast);
})

NETTAP_TP("tracepoint/syscalls/sys_exit_read", tcp_recvmsg_exit, struct trace_event_raw_sys_exit,
	  "probe=tcp_recvmsg attach=sys_exit_read,sys_exit_recvfrom,sys_exit_readv,sys_exit_recvmsg", {
	return exit_call(NETTAP_PROBE_TCP_RECVMSG, ctx->ret, fast);
})
// clang-format on

#endif /* NETTAP_ENTRY_TP_BPF_H */
