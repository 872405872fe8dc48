/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * timer.bpf.h: the slot of the captured socket's timer this CPU's wheel is
 * running, shared by tcp_timer and tcp_timer_exit (retransmit.bpf.c) and
 * tcp_destroy (lifecycle.bpf.c), which empties it for a destroyed socket.
 */
#ifndef NETTAP_TIMER_BPF_H
#define NETTAP_TIMER_BPF_H

#include <bpf/bpf_tracing.h>
#include "obs.bpf.h"

/* The timer programs run for every timer of the node and say no to all
 * but nettap's at their first compare. Where what follows is long, it is a
 * subprogram (__noinline): the program's exit then follows the compare (the
 * JIT puts its epilogue at the first exit), so a no touches the program's
 * first lines only, not a line ~400-700 instructions on (a no on a CPU that
 * had been idle took ~2.8x an empty program's run: docs/benchmarks.md). */

/* The socket a timer_list is a member of: the timer's address less the
 * member's offset (CO-RE). A BTF pointer less a constant stays one. */
#define TIMER_OWNER(timer, type, member) \
	((const struct sock *)((void *)(timer)-bpf_core_field_offset(type, member)))

/* The captured socket's timer this CPU's wheel is running, kept by
 * tcp_timer for tcp_timer_exit: the timer (its address, a number), its
 * socket, which timer and icsk_probes_out before it ran. Timers of one CPU
 * run one after the other (in its softirq, or its softirq thread on
 * PREEMPT_RT). timer 0: none. */
struct nettap_timer_slot {
	__u64 timer;
	__u64 sk;
	__u8 which;
	__u8 probes_out;
	__u8 pad[6];
};

NETTAP_SHARED struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nettap_timer_slot);
} timer_slot SEC(".maps");

/* CPUs whose slot holds a timer: tcp_timer_exit, which runs after every
 * timer of the node, reads this and nothing else while it is 0. */
NETTAP_SHARED __u32 timer_slots_armed SEC(".bss.timers");

static __always_inline struct nettap_timer_slot *timer_slot_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&timer_slot, &zero);
}

/* Empty the slot (a destroyed socket's, whose memory its timer's sock_put
 * may free before the timer returns). */
static __always_inline void timer_slot_clear(struct nettap_timer_slot *slot)
{
	slot->timer = 0;
	slot->sk = 0;
	__sync_fetch_and_add(&timer_slots_armed, -1);
}

#endif /* NETTAP_TIMER_BPF_H */
