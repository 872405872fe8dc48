// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* The baseline of bench/probe_cost.py: programs that do nothing, on the
 * attach points nettap's send probe uses in each mechanism, so the table
 * shows what any BPF program costs there on this machine. The benchmark
 * loads only the pair of the mechanism it measures. */
#include "../bpf/vmlinux_min.h"
#include <bpf/bpf_helpers.h>

/* Tracepoint pair: attached by bench/probe_cost.py to every syscall the
 * nettap program it is measured beside serves; the SEC names one of them. */
SEC("tracepoint/syscalls/sys_enter_sendto")
int empty_tp_enter(void *ctx) { return 0; }

SEC("tracepoint/syscalls/sys_exit_sendto")
int empty_tp_exit(void *ctx) { return 0; }

SEC("fentry/tcp_sendmsg")
int empty_fentry_enter(void *ctx) { return 0; }

SEC("fexit/tcp_sendmsg")
int empty_fentry_exit(void *ctx) { return 0; }

SEC("kprobe/tcp_sendmsg")
int empty_kprobe_enter(void *ctx) { return 0; }

SEC("kretprobe/tcp_sendmsg")
int empty_kprobe_exit(void *ctx) { return 0; }

/* The lifecycle programs' tracepoints (BTF raw tracepoints, as nettap's). */
SEC("tp_btf/inet_sock_set_state")
int empty_lc_state(void *ctx) { return 0; }

SEC("tp_btf/tcp_destroy_sock")
int empty_lc_destroy(void *ctx) { return 0; }

SEC("tp_btf/tcp_send_reset")
int empty_lc_rst_sent(void *ctx) { return 0; }

SEC("tp_btf/tcp_receive_reset")
int empty_lc_rst_recv(void *ctx) { return 0; }

SEC("tp_btf/inet_sk_error_report")
int empty_lc_sk_error(void *ctx) { return 0; }

SEC("tp_btf/tcp_probe")
int empty_lc_segment(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_entry")
int empty_lc_timer(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_exit")
int empty_lc_timer_exit(void *ctx) { return 0; }

SEC("tp_btf/timer_start")
int empty_lc_timewait(void *ctx) { return 0; }

SEC("tp_btf/timer_cancel")
int empty_lc_timewait_end(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_entry")
int empty_lc_timewait_expire(void *ctx) { return 0; }

SEC("tp_btf/timer_start")
int empty_lc_request(void *ctx) { return 0; }

SEC("tp_btf/timer_cancel")
int empty_lc_request_end(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_exit")
int empty_lc_request_exit(void *ctx) { return 0; }

SEC("tp_btf/inet_sock_set_state")
int empty_lc_request_state(void *ctx) { return 0; }

/* Leads: attached first on each tracepoint of the closing and expiring
 * cases, so that neither nettap's program nor its empty one is the first
 * there (the first pays ~21 ns a run more, whichever it is: bench/steps.py). */
SEC("tp_btf/timer_start")
int empty_lead_start(void *ctx) { return 0; }

SEC("tp_btf/timer_cancel")
int empty_lead_cancel(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_entry")
int empty_lead_expire_entry(void *ctx) { return 0; }

SEC("tp_btf/timer_expire_exit")
int empty_lead_expire_exit(void *ctx) { return 0; }

SEC("tp_btf/inet_sock_set_state")
int empty_lead_state(void *ctx) { return 0; }

SEC("tp_btf/tcp_retransmit_skb")
int empty_lc_retransmit(void *ctx) { return 0; }

SEC("tp_btf/tcp_retransmit_synack")
int empty_lc_synack(void *ctx) { return 0; }

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* libssl's SSL_write_ex (uprobes, attached by the benchmark: bench/tls_cost.py). */
SEC("uprobe")
int empty_ssl_enter(void *ctx) { return 0; }

SEC("uretprobe")
int empty_ssl_exit(void *ctx) { return 0; }

/* Go's crypto/tls.(*Conn).Write: its entry, and each RET instruction (plain
 * uprobes at file offsets: bench/tls_cost.py). */
SEC("uprobe")
int empty_go_enter(void *ctx) { return 0; }

SEC("uprobe")
int empty_go_ret(void *ctx) { return 0; }
