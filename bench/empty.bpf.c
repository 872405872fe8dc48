// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* The baseline of bench/probe_cost.py: programs that do nothing, on the
 * tracepoints nettap's send probe uses, so the table shows what any BPF
 * program costs there on this machine. */
#include "../bpf/vmlinux_min.h"
#include <bpf/bpf_helpers.h>

SEC("tracepoint/syscalls/sys_enter_sendto")
int empty_enter(void *ctx) { return 0; }

SEC("tracepoint/syscalls/sys_exit_sendto")
int empty_exit(void *ctx) { return 0; }

char LICENSE[] SEC("license") = "Dual BSD/GPL";
