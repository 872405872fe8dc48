// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * calls.bpf.c: the probes tcp_sendmsg and tcp_recvmsg, each in three attach
 * mechanisms (syscall tracepoints: entry_tp.bpf.h; fentry/fexit and
 * kprobe/kretprobe: entry_func.bpf.h) and two variants (emit.bpf.h). User
 * space chooses per probe, before load, the mechanism and the variant the
 * kernel accepts (exporter/kernel/mechanisms.py) and switches every other
 * program's autoload off.
 */
#include "entry_tp.bpf.h"
#include "entry_func.bpf.h"

// clang-format off
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

NETTAP_FENTRY(tcp_sendmsg, NETTAP_PROBE_TCP_SENDMSG)
NETTAP_FENTRY(tcp_recvmsg, NETTAP_PROBE_TCP_RECVMSG)
NETTAP_KPROBE(tcp_sendmsg, NETTAP_PROBE_TCP_SENDMSG)
NETTAP_KPROBE(tcp_recvmsg, NETTAP_PROBE_TCP_RECVMSG)
