// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tcp.bpf.c: nettap's TCP send/receive and lifecycle probes.
 *
 * Two probes, tcp_sendmsg and tcp_recvmsg, each in three attach mechanisms
 * (fentry/fexit, kprobe/kretprobe, syscall tracepoints) and two variants
 * (fast for Linux 6.2+, compat for 5.8+; see emit.bpf.h). Every mechanism
 * captures the payload. User space (exporter/kernel/loader.py) decides per probe,
 * before load, which mechanism and variant the kernel accepts and switches
 * every other program's autoload off.
 *
 * Layout (one concern a file):
 *   tcp.h              what crosses to user space (records, constants)
 *   vmlinux_min.h      the kernel types read, for CO-RE
 *   core_fixes.bpf.h   kernel-version differences, one block per change
 *   maps.bpf.h         the maps and the per-call state
 *   conn.bpf.h         the connection table, counters, logs, addresses
 *   filter.bpf.h       the capture filter
 *   emit.bpf.h         entry and return bodies: chunking
 *   entry_tp.bpf.h     syscall-tracepoint entry points
 *   entry_func.bpf.h   fentry/fexit and kprobe/kretprobe entry points
 *   tcp.bpf.c          this file: the lifecycle program
 */
#include "entry_tp.bpf.h"
#include "entry_func.bpf.h"

/* Typed globals put the record layouts into the object's BTF, where
 * tests/unit/test_layout.py compares them with exporter/capture/records.py. */
struct nettap_chunk btf_nettap_chunk __attribute__((unused));
struct nettap_eof btf_nettap_eof __attribute__((unused));
struct nettap_log btf_nettap_log __attribute__((unused));

/* Publish a captured connection's totals and forget it; nothing when the
 * socket is not in the table. One body for both lifecycle programs: it runs
 * once per captured connection, so its reads go through
 * bpf_probe_read_kernel and its adds do not fetch. */
static __always_inline int publish_eof(const struct sock *sk, int oldstate)
{
	struct nettap_capture_config *cfg;
	struct nettap_eof *e;
	struct conn *cn;
	__u64 key, id;
	__u32 zero = 0;

	key = (__u64)sk;
	cn = bpf_map_lookup_elem(&capture_conns, &key);
	if (!cn)
		return 0;

	cfg = bpf_map_lookup_elem(&capture_config, &zero);
	e = bpf_ringbuf_reserve(&capture_eof, sizeof(*e), 0);
	if (!e) {
		count_drop(NETTAP_RING_CAPTURE_EOF, 1);
	} else {
		id = bpf_get_current_pid_tgid();
		e->h.ts_ns = bpf_ktime_get_ns();
		e->h.conn_id = cn->id;
		e->h.kind = NETTAP_KIND_EOF;
		e->h.pid = cn->pid;
		e->start_ns = cn->start_ns;
		e->tx_bytes = cn->tx_off;
		e->rx_bytes = cn->rx_off;
		e->tx_calls = cn->tx_calls;
		e->rx_calls = cn->rx_calls;
		e->tid = (__u32)id;
		e->oldstate = oldstate;
		e->pad0 = 0;
		__builtin_memset(e->pad1, 0, sizeof(e->pad1));
		read_addrs((struct sock *)sk, false, &e->family, &e->sport, &e->dport, e->saddr,
			   e->daddr);
		bpf_get_current_comm(e->comm, sizeof(e->comm));
		bpf_ringbuf_submit(e, cfg ? wakeup_flags(&capture_eof, NETTAP_RING_CAPTURE_EOF,
							 cfg->eof_wakeup_bytes)
					  : BPF_RB_NO_WAKEUP);
	}
	if (!bpf_map_delete_elem(&capture_conns, &key))
		conns_live_add(-1);
	return 0;
}

/* A captured connection reached TCP_CLOSE: publish its totals, forget it.
 *
 * A BTF raw tracepoint, not the classic tracepoint of the same name: the
 * classic one shares the per-CPU bpf_prog_active guard with every tracing
 * program, so when TCP_CLOSE is reached in a softirq that interrupted any
 * BPF program on that CPU (the send-path programs run on every syscall),
 * the kernel skips this run silently. A raw tracepoint's guard is per
 * program: it is skipped only when a softirq interrupts this very program,
 * and the kernel counts that (the program's misses). tcp_destroy below
 * catches what such a skipped run leaves. Needs vmlinux BTF, nettap's floor. */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(tcp_state, const struct sock *sk, int oldstate, int newstate)
{
	if (newstate != TCP_CLOSE || BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP)
		return 0;
	return publish_eof(sk, oldstate);
}

/* The socket is destroyed (tcp_v4_destroy_sock, IPv6 too): whatever entry
 * it still has goes now, so no later socket at this address inherits it.
 * An entry is still here when tcp_state's run at TCP_CLOSE was skipped by
 * the kernel (its own guard; a separate program has a separate one), or
 * when data still queued after TCP_CLOSE (a peer reset) was read. Its eof
 * carries oldstate TCP_CLOSE: the state before close is not known here. */
SEC("tp_btf/tcp_destroy_sock")
int BPF_PROG(tcp_destroy, struct sock *sk)
{
	return publish_eof(sk, TCP_CLOSE);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
