// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* bench/steps.py's programs: each one step of what a timer program of
 * nettap does before it says no (bpf/timewait.bpf.c, bpf/request.bpf.c),
 * alone, on timer:timer_start. A lead program, attached first, takes what
 * the first program on a tracepoint pays more than the others. */
#include "../bpf/vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "GPL";

/* a value no timer has: each step's compare says no, as nettap's does for
 * a timer that is none of its own */
__u64 step_handler SEC(".data.steps") = 0x1234;

SEC("tp_btf/timer_start")
int step_lead(void *ctx)
{
	return 0;
}

SEC("tp_btf/timer_start")
int step_empty(void *ctx)
{
	return 0;
}

/* the timer's function against a constant: one load from the timer */
SEC("tp_btf/timer_start")
int BPF_PROG(step_function, struct timer_list *timer)
{
	return (__u64)timer->function == 0x1234ULL;
}

/* ... against a global, as nettap's (struct nettap_ksyms): a second load */
SEC("tp_btf/timer_start")
int BPF_PROG(step_function_global, struct timer_list *timer)
{
	return (__u64)timer->function == step_handler;
}

/* a helper call: 4 bytes of the timer read by bpf_probe_read_kernel, as the
 * compat paths read a socket */
SEC("tp_btf/timer_start")
int BPF_PROG(step_probe_read, struct timer_list *timer)
{
	__u32 v = 0;

	bpf_probe_read_kernel(&v, sizeof(v), timer);
	return v == 0x1234;
}
