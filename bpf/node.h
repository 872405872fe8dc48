/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * node.h: what bpf/node.bpf.c writes for each BPF program of the node, one
 * row after another, to whoever reads its iterator (exporter/kernel/nodewalk.py
 * reads it; tests/kernel/test_nodewalk.py checks it against the kernel's
 * answer by bpf(2)). No includes, padding written out.
 */
#ifndef NETTAP_NODE_H
#define NETTAP_NODE_H

struct nettap_node_prog {
	__u32 id;	   /* the program's id */
	__u32 type;	   /* enum bpf_prog_type */
	__u64 run_cnt;	   /* runs, summed over the possible CPUs (BPF statistics) */
	__u64 run_time_ns; /* kernel run time, summed likewise */
	char name[16];	   /* the kernel's name (BPF_OBJ_NAME_LEN), NUL-padded */
};

#endif /* NETTAP_NODE_H */
