// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tcp.bpf.c: the object tcp.bpf.o, nettap's probes, one family a file, each
 * with its programs (each tagged NETTAP_PROG, bpf/tcp.h: the program table
 * user space reads is generated from the tags, docs/architecture.md#adding-a-probe):
 *   calls.bpf.c        tcp_sendmsg, tcp_recvmsg: three mechanisms, two variants
 *   tls.bpf.c          ssl_write, ssl_read, ssl_handshake: uprobes on libssl
 *   retransmit.bpf.c   tcp_retransmit, tcp_synack_retransmit, tcp_timer,
 *                      tcp_timer_exit, tcp_segment
 *   dns.bpf.c          dns: three mechanisms, two variants
 *   lifecycle.bpf.c    tcp_state (states, eof, resets, destruction), tcp_accept,
 *                      tcp_sk_error
 *   timewait.bpf.c     tcp_timewait: captured connections' TIME_WAIT sockets
 *   request.bpf.c      tcp_request: captured listeners' request sockets
 * and what they share, in headers (one concern a file):
 *   tcp.h              what crosses to user space (records, constants, tags)
 *   vmlinux_min.h      the kernel types read, for CO-RE
 *   shared.bpf.h       the maps and globals shared: defined here, extern elsewhere
 *   core_fixes.bpf.h   kernel-version differences, one block per change
 *   maps.bpf.h         the maps and the per-call state
 *   conn.bpf.h         the connection table, counters, logs, addresses
 *   filter.bpf.h       the capture filter
 *   obs.bpf.h          obs_events records and the lifecycle counters
 *   emit.bpf.h         entry and return bodies: chunking
 *   entry_tp.bpf.h     the syscall-tracepoint mechanism (NETTAP_TP)
 *   entry_func.bpf.h   the fentry/fexit and kprobe/kretprobe mechanisms
 *   tls.bpf.h          TLS calls in flight, and how each learns its socket
 *   timer.bpf.h        the timer slot tcp_timer and tcp_destroy share
 *   timewait.bpf.h     TIME_WAIT sockets followed, shared with tcp_state
 *
 * Each family is its own compilation unit; bpf/Makefile links them into one
 * object with `bpftool gen object`, as bpf2go and libbpf-bootstrap do. This
 * file is the first unit linked: it defines the maps and globals the families
 * share (built with -DNETTAP_DATA_OWNER, shared.bpf.h), the license and the
 * typed globals below; the families see extern declarations of the same maps.
 */
#include "emit.bpf.h"
#include "timer.bpf.h"
#include "timewait.bpf.h"

/* Typed globals put the record layouts into the object's BTF, where
 * tests/unit/test_layout.py compares them with exporter/capture/records.py. */
struct nettap_chunk btf_nettap_chunk __attribute__((unused));
struct nettap_eof btf_nettap_eof __attribute__((unused));
struct nettap_log btf_nettap_log __attribute__((unused));
struct nettap_state btf_nettap_state __attribute__((unused));
struct nettap_reset btf_nettap_reset __attribute__((unused));
struct nettap_owner btf_nettap_owner __attribute__((unused));
struct nettap_error btf_nettap_error __attribute__((unused));
struct nettap_destroy btf_nettap_destroy __attribute__((unused));
struct nettap_tls_handshake btf_nettap_tls_handshake __attribute__((unused));
struct nettap_dlopen btf_nettap_dlopen __attribute__((unused));
struct nettap_retransmit btf_nettap_retransmit __attribute__((unused));
struct nettap_synack_retransmit btf_nettap_synack_retransmit __attribute__((unused));
struct nettap_timer btf_nettap_timer __attribute__((unused));
struct nettap_probe btf_nettap_probe __attribute__((unused));
struct nettap_segment btf_nettap_segment __attribute__((unused));
struct nettap_dns btf_nettap_dns __attribute__((unused));
struct nettap_timewait btf_nettap_timewait __attribute__((unused));
struct nettap_request btf_nettap_request __attribute__((unused));

char LICENSE[] SEC("license") = "Dual BSD/GPL";
