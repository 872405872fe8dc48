/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The few kernel types nettap's programs read, declared for CO-RE.
 *
 * Instead of a 3 MB vmlinux.h generated from one kernel, these declare only
 * the members the programs touch, with preserve_access_index: libbpf
 * relocates every access against the running kernel's BTF at load time, by
 * member name (anonymous unions in the real structs are matched through).
 * The compiled object therefore does not depend on the build machine's
 * kernel, and rebuilds byte-identically.
 */
#ifndef NETTAP_VMLINUX_MIN_H
#define NETTAP_VMLINUX_MIN_H
/* Tells bpf_tracing.h to use the kernel's pt_regs member names. */
#define __VMLINUX_H__

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;
typedef signed char __s8;
typedef short __s16;
typedef int __s32;
typedef long long __s64;
typedef __u16 __be16;
typedef __u32 __be32;
typedef __u32 __wsum;
typedef _Bool bool;
typedef unsigned short umode_t;
typedef int pid_t;

enum { false = 0, true = 1 };

struct iovec;

enum bpf_map_type {
	BPF_MAP_TYPE_HASH = 1,
	BPF_MAP_TYPE_ARRAY = 2,
	BPF_MAP_TYPE_PERCPU_ARRAY = 6,
	BPF_MAP_TYPE_LRU_HASH = 9,
	BPF_MAP_TYPE_RINGBUF = 27,
	BPF_MAP_TYPE_TASK_STORAGE = 29,
};

enum {
	BPF_F_NO_PREALLOC = 1,
	BPF_LOCAL_STORAGE_GET_F_CREATE = 1,
};

enum {
	BPF_ANY = 0,
	BPF_NOEXIST = 1,
	BPF_EXIST = 2,
};

enum {
	BPF_RB_NO_WAKEUP = 1,
	BPF_RB_FORCE_WAKEUP = 2,
};

enum {
	BPF_RB_AVAIL_DATA = 0,
	BPF_RB_RING_SIZE = 1,
	BPF_RB_CONS_POS = 2,
	BPF_RB_PROD_POS = 3,
};

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

struct in6_addr {
	union {
		__u8 u6_addr8[16];
	} in6_u;
};

struct ns_common {
	unsigned int inum;
};

struct net {
	struct ns_common ns;
};

typedef struct {
	struct net *net;
} possible_net_t;

struct hlist_nulls_node {
	struct hlist_nulls_node *next, **pprev;
};

struct sock_common {
	__be32 skc_daddr;
	__be32 skc_rcv_saddr;
	__be16 skc_dport;
	__u16 skc_num;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	possible_net_t skc_net;
	struct sock *skc_listener;		/* a request's listener (its rsk_listener) */
	struct hlist_nulls_node skc_nulls_node; /* pprev 0: not in the established hash */
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
};

struct timer_list {
	unsigned long expires;
	void (*function)(struct timer_list *);
};

typedef struct {
	int owned; /* sock_owned_by_user() */
} socket_lock_t;

struct sk_buff;

struct sk_buff_head {
	struct sk_buff *next; /* the list's head itself when it is empty */
};

typedef struct {
	int counter;
} atomic_t;

/* Linux 6.18's sk_drop_counters (absent before): a socket may keep its
 * drops split over NUMA nodes, which sk_drops_read() adds to sk_drops
 * where the pointer is set (UDP's; not TCP's). */
struct numa_drop_counters {
	atomic_t drops0;
	atomic_t drops1;
};

struct sock {
	struct sock_common __sk_common;
	atomic_t sk_drops; /* a listener's: SYNs and ACKs dropped, its queues full (tcp_listendrop) */
	struct numa_drop_counters *sk_drop_counters;
	struct sk_buff_head sk_receive_queue;
	socket_lock_t sk_lock;
	struct timer_list sk_timer; /* a TCP socket's keepalive timer */
	__u16 sk_type;
	__u16 sk_protocol;
	int sk_err;
	__u32 sk_ack_backlog;	  /* a listener's accept queue: its length, */
	__u32 sk_max_ack_backlog; /* full above this (sk_acceptq_is_full) */
};

struct request_sock_queue {
	__u8 rskq_defer_accept; /* TCP_DEFER_ACCEPT, in SYN-ACK timeouts */
};

/* Linux 6.15 dropped icsk_timeout: the retransmit timer's expires is the
 * same value on every kernel (sk_reset_timer sets it). */
struct inet_connection_sock {
	struct timer_list icsk_retransmit_timer;
	__u32 icsk_rto;
	__u8 icsk_ca_state : 5; /* a bitfield on every kernel: BPF_CORE_READ_BITFIELD_PROBED */
	__u8 icsk_retransmits;
	__u8 icsk_pending;
	__u8 icsk_probes_out;
	struct request_sock_queue icsk_accept_queue;
};

/* A TIME_WAIT socket (include/net/inet_timewait_sock.h): its tw_timer a
 * timer_list since Linux 4.3 (commit 789f558cfb36 "tcp/dccp: get rid of
 * central timewait timer"). */
struct inet_timewait_sock {
	struct sock_common __tw_common;
	volatile unsigned char tw_substate;
	struct timer_list tw_timer;
};

struct request_sock {
	__u8 num_retrans;
	__u8 num_timeout : 7; /* a bitfield on every kernel: BPF_CORE_READ_BITFIELD_PROBED */
	struct timer_list rsk_timer;
};

struct inet_request_sock {
	__u16 acked : 1; /* a bitfield on every kernel: BPF_CORE_READ_BITFIELD_PROBED */
};

struct tcp_sock {
	__u32 srtt_us; /* smoothed round-trip time << 3, in us */
	__u64 bytes_received;
	__u32 segs_in;
	__u32 segs_out;
	__u64 bytes_acked;
	__u32 total_retrans;
	__u32 snd_wnd; /* the window the peer advertised */
	__u32 rcv_wnd; /* the window this socket advertised */
	__u32 snd_cwnd;
	__u32 snd_ssthresh;
};

struct sk_buff {
	unsigned int len;
	unsigned char *data;
	unsigned char *head;
	unsigned int end;	/* skb_shinfo's offset from head (64-bit kernels) */
	__u16 transport_header; /* offsets from head */
	__u16 network_header;
};

/* at skb->head + skb->end: gso_segs, the segments one skb stands for (0 or
 * 1 for one), as tcp_segs_in counts them */
struct skb_shared_info {
	unsigned short gso_segs;
};

/* UDP's second receive queue (Linux 4.13): a receive takes from it first,
 * and moves sk_receive_queue into it when it is empty (__skb_recv_udp). */
struct udp_sock {
	struct sk_buff_head reader_queue;
};

struct inet_sock {
	struct sock sk;
	__be16 inet_sport;
};

struct file;

struct socket {
	short type;
	struct file *file;
	struct sock *sk;
};

struct super_block {
	__u32 s_dev; /* dev_t */
};

struct inode {
	umode_t i_mode;
	unsigned long i_ino;
	struct super_block *i_sb;
};

struct qstr {
	const unsigned char *name;
};

struct dentry {
	struct qstr d_name;
};

struct path {
	struct dentry *dentry;
};

/* A socket's inode follows its struct socket (net/socket.c, sock_alloc_inode). */
struct socket_alloc {
	struct socket socket;
	struct inode vfs_inode;
};

struct file {
	struct path f_path;
	struct inode *f_inode;
	void *private_data;
};

struct fdtable {
	unsigned int max_fds;
	struct file **fd;
};

struct files_struct {
	struct fdtable *fdt;
	struct file *fd_array[1]; /* NR_OPEN_DEFAULT entries; only its offset is used */
};

/* Linux 5.14+ (commit 8cd54c1c8480 "iov_iter: separate direction from
 * flavour"); older kernels: struct iov_iter___old in core_fixes.bpf.h. */
enum iter_type {
	ITER_IOVEC = 0,
	ITER_KVEC = 1,
	ITER_BVEC = 2,
	ITER_UBUF = 6,
};

struct iov_iter {
	__u8 iter_type;
	__u64 iov_offset;
	__u64 count;
	const struct iovec *iov; /* renamed __iov in 6.4: core_fixes.bpf.h */
	void *ubuf;
	unsigned long nr_segs;
};

struct msghdr {
	void *msg_name; /* the kernel's copy of the caller's address */
	struct iov_iter msg_iter;
};

/* The register frame of a kprobe or uprobe, as bpf_tracing.h reads it for
 * the object's __TARGET_ARCH_ (bpf/Makefile builds one object per
 * architecture): member names only, relocated against the running kernel's
 * BTF. The Go register ABI's reads are in gotls.bpf.c (GO_ARG1, GO_G). */
#if defined(__TARGET_ARCH_x86)
/* x86-64 (arch/x86/include/asm/ptrace.h); the kernel's names, as
 * __VMLINUX_H__ asks of bpf_tracing.h (di, si, ..., ax). */
struct pt_regs {
	unsigned long r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	unsigned long ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};
#elif defined(__TARGET_ARCH_arm64)
/* arm64 (arch/arm64/include/uapi/asm/ptrace.h, asm/ptrace.h): bpf_tracing.h
 * reads every PT_REGS_* through struct user_pt_regs (regs[0..30], sp, pc),
 * which begins the kernel's pt_regs, and the syscall wrappers' first
 * argument (PT_REGS_PARM1_CORE_SYSCALL) from pt_regs::orig_x0 with its own
 * pt_regs___arm64 flavour. */
struct user_pt_regs {
	__u64 regs[31];
	__u64 sp;
	__u64 pc;
	__u64 pstate;
};

struct pt_regs {
	union {
		struct user_pt_regs user_regs;
		struct {
			__u64 regs[31];
			__u64 sp;
			__u64 pc;
			__u64 pstate;
		};
	};
	__u64 orig_x0;
};
#else
#error "bpf/Makefile builds for __TARGET_ARCH_x86 and __TARGET_ARCH_arm64"
#endif

struct cgroup {
	int level;
};

struct css_set {
	struct cgroup *dfl_cgrp;
};

struct mm_struct {
	struct file *exe_file;
};

struct task_struct {
	struct mm_struct *mm;
	struct files_struct *files;
	struct css_set *cgroups;
	__u64 start_time;
};

struct trace_event_raw_inet_sock_set_state {
	const void *skaddr;
	int oldstate;
	int newstate;
	__u16 protocol;
};

#pragma clang attribute pop

/* Syscall tracepoint records: their layout is the tracepoint ABI
 * (/sys/kernel/tracing/events/syscalls/sys_enter_write/format), not a
 * kernel struct, so no CO-RE relocation applies. */
struct trace_event_raw_sys_enter {
	__u64 ent;
	long id;
	unsigned long args[6];
};

struct trace_event_raw_sys_exit {
	__u64 ent;
	long id;
	long ret;
};

/* User-space ABI structs (uapi/linux/uio.h, include/linux/socket.h). */
struct iovec {
	void *iov_base;
	__u64 iov_len;
};

struct user_msghdr {
	void *msg_name;
	int msg_namelen;
	struct iovec *msg_iov;
	__u64 msg_iovlen;
	void *msg_control;
	__u64 msg_controllen;
	unsigned int msg_flags;
};

#endif /* NETTAP_VMLINUX_MIN_H */
