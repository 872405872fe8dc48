// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * node.bpf.c: the node's BPF programs and their run-time statistics, for
 * bpfStats scope node, by one BPF iterator (iter/bpf_prog, Linux 5.19+ for
 * bpf_map_lookup_percpu_elem): one read(2) of the iterator gives a row
 * (node.h) per program, where asking bpf(2) costs four calls a program
 * (next id, fd by id, info, close). exporter/kernel/nodewalk.py loads it
 * the first time a scrape wants the node's programs and falls back to the
 * bpf(2) walk where the kernel refuses it.
 *
 * A program's statistics are per CPU (struct bpf_prog_stats, a per-CPU
 * allocation): the sum over the possible CPUs is what BPF_OBJ_GET_INFO_BY_FD
 * answers. A per-CPU pointer is an offset into each CPU's area, and the
 * kernel's BTF does not mark prog->stats as one, so bpf_per_cpu_ptr() is
 * refused on it. Each CPU's area is found from a per-CPU array of this
 * object instead: its element's address on CPU c (bpf_map_lookup_percpu_elem)
 * minus the element's per-CPU pointer (the array's pptrs[0]) is CPU c's
 * offset, the same for every per-CPU allocation. What is read through those
 * addresses is read by bpf_probe_read_kernel.
 */
#include "vmlinux_min.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "node.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define NETTAP_NODE_MAX_CPUS 8192

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

/* A u64 on 64-bit kernels (local64_t), a struct since Linux 5.12. */
typedef struct {
	__u64 v;
} u64_stats_t;

struct bpf_prog_stats {
	u64_stats_t cnt;
	u64_stats_t nsecs;
} __attribute__((preserve_access_index));

struct bpf_prog_aux {
	__u32 id;
	char name[16];
} __attribute__((preserve_access_index));

enum bpf_prog_type { BPF_PROG_TYPE_UNSPEC = 0 };

struct bpf_prog {
	enum bpf_prog_type type;
	struct bpf_prog_stats *stats;
	struct bpf_prog_aux *aux;
} __attribute__((preserve_access_index));

struct bpf_iter__bpf_prog {
	struct bpf_iter_meta *meta;
	struct bpf_prog *prog;
} __attribute__((preserve_access_index));

struct bpf_array {
	void *pptrs[0];
} __attribute__((preserve_access_index));

/* Its element is never used: the array is there for its per-CPU addresses. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} node_cpus SEC(".maps");

/* A pointer's value as a number (the verifier allows no arithmetic on most
 * pointers, and a privileged program may read its own stack). */
static __always_inline __u64 address_of(const void *p)
{
	__u64 a = 0;

	bpf_probe_read_kernel(&a, sizeof(a), &p);
	return a;
}

struct sum_ctx {
	__u64 stats; /* the program's per-CPU pointer to its statistics */
	__u64 base;  /* node_cpus' element's per-CPU pointer */
	__u64 cnt;
	__u64 nsecs;
};

static long add_cpu(__u32 cpu, struct sum_ctx *s)
{
	__u32 zero = 0;
	const void *elem = bpf_map_lookup_percpu_elem(&node_cpus, &zero, cpu);
	__u64 at, v[2];

	if (!elem) /* past the last possible CPU */
		return 1;
	at = s->stats + (address_of(elem) - s->base);
	if (bpf_core_field_offset(struct bpf_prog_stats, nsecs) !=
	    bpf_core_field_offset(struct bpf_prog_stats, cnt) + 8)
		return 1;
	if (bpf_probe_read_kernel(v, sizeof(v),
				  (void *)(at + bpf_core_field_offset(struct bpf_prog_stats, cnt))))
		return 0;
	s->cnt += v[0];
	s->nsecs += v[1];
	return 0;
}

SEC("iter/bpf_prog")
int node_programs(struct bpf_iter__bpf_prog *ctx)
{
	struct bpf_prog *prog = ctx->prog;
	struct nettap_node_prog row = {};
	struct sum_ctx s = {};
	struct bpf_prog_aux *aux;

	if (!prog) /* the iteration's end */
		return 0;
	aux = BPF_CORE_READ(prog, aux);
	row.id = BPF_CORE_READ(aux, id);
	row.type = BPF_CORE_READ(prog, type);
	bpf_probe_read_kernel(row.name, sizeof(row.name), aux->name);
	s.stats = (__u64)BPF_CORE_READ(prog, stats);
	bpf_probe_read_kernel(
		&s.base, sizeof(s.base),
		(void *)(address_of(&node_cpus) + bpf_core_field_offset(struct bpf_array, pptrs)));
	if (s.stats && s.base)
		bpf_loop(NETTAP_NODE_MAX_CPUS, add_cpu, &s, 0);
	row.run_cnt = s.cnt;
	row.run_time_ns = s.nsecs;
	bpf_seq_write(ctx->meta->seq, &row, sizeof(row));
	return 0;
}
