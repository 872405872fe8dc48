/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * tcp.h: every constant and struct that crosses between bpf/'s programs and
 * user space (exporter/capture/records.py mirrors these; tests/unit/test_layout.py
 * checks the Python layout against the BTF compiled into bpf/tcp.bpf.o).
 *
 * No includes: plain __u8/__u16/__u32/__u64 fields, padding written out.
 * Every ring record starts with struct nettap_hdr, whose kind says which
 * record it is, so one ring may carry several kinds; each kind has a fixed
 * size (docs/records.md lists them, generated from this file).
 */
#ifndef NETTAP_TCP_H
#define NETTAP_TCP_H

/* What user space cannot tell from a field's C type, said on the field and
 * compiled into the object's BTF as a decl tag (scripts/gen_layout.py reads
 * it; docs/records.md lists the forms): how the field is written in a JSON
 * line. NETTAP_RECORD names a ring record's kind (its JSON "type") and ring. */
#define NETTAP_JSON(form)	  __attribute__((btf_decl_tag("json:" form)))
#define NETTAP_RECORD(kind, ring) __attribute__((btf_decl_tag("record:" kind ":" ring)))
/* On a program: what user space needs to load and attach it, read from the
 * object's BTF by scripts/gen_layout.py into exporter/kernel/programs_h.py
 * (docs/architecture.md#adding-a-probe). Space-separated key=value:
 * probe=NAME[,NAME] the probe(s) it serves (nettap_probe_attached's label),
 * mech=MECHANISM the attach mechanism it belongs to, variant=fast|compat
 * (none: both variants load it), needs=FEATURE (exporter/kernel/features.py)
 * where the kernel must have one, attach=A[,B] what it is attached to where
 * its SEC does not say (tracepoints of the SEC's category; uprobe symbols),
 * records=KIND[,KIND] on a program that runs only for these record kinds (and
 * their counters): attached while capture.records asks for one of them. */
#define NETTAP_PROG(spec)	  __attribute__((btf_decl_tag("prog:" spec)))
/* On a map: variant=fast|compat (created for that variant only),
 * prealloc=always (preallocated on every kernel), prealloc_max=N (its
 * max_entries where it must be preallocated: before Linux 6.1). */
#define NETTAP_MAP(spec)	  __attribute__((btf_decl_tag("map:" spec)))

/* Record kinds: nettap_hdr.kind, and the line's "type" (the kind's name in
 * NETTAP_RECORD). 0 is no kind: zeroed memory is never a record. */
#define NETTAP_KIND_CHUNK	      1
#define NETTAP_KIND_EOF		      2
#define NETTAP_KIND_LOG		      3
#define NETTAP_KIND_STATE	      4
#define NETTAP_KIND_RESET	      5
#define NETTAP_KIND_OWNER	      6
#define NETTAP_KIND_ERROR	      7
#define NETTAP_KIND_DESTROY	      8
#define NETTAP_KIND_TLS_HANDSHAKE     9
#define NETTAP_KIND_DLOPEN	      10
#define NETTAP_KIND_RETRANSMIT	      11
#define NETTAP_KIND_SYNACK_RETRANSMIT 12
#define NETTAP_KIND_TIMER	      13
#define NETTAP_KIND_PROBE	      14
#define NETTAP_KIND_SEGMENT	      15
#define NETTAP_KIND_DNS		      16
#define NETTAP_KIND_TIMEWAIT	      17
#define NETTAP_KIND_REQUEST	      18

/* Probe indexes: rows of the probe_counters map, and the `probe` label. */
#define NETTAP_PROBE_TCP_SENDMSG   0
#define NETTAP_PROBE_TCP_RECVMSG   1
#define NETTAP_PROBE_SSL_WRITE	   2 /* SSL_write, SSL_write_ex: plaintext sent */
#define NETTAP_PROBE_SSL_READ	   3 /* SSL_read, SSL_read_ex: plaintext received */
#define NETTAP_PROBE_SSL_HANDSHAKE 4 /* SSL_do_handshake (SSL_connect, SSL_accept call it) */
#define NETTAP_PROBE_DNS	   5 /* DNS messages over UDP and TCP (bpf/dns.bpf.c) */
#define NETTAP_PROBE_GO_TLS_WRITE  6 /* Go's crypto/tls.(*Conn).Write: plaintext sent */
#define NETTAP_PROBE_GO_TLS_READ   7 /* Go's crypto/tls.(*Conn).Read: plaintext received */
#define NETTAP_PROBE_COUNT	   8

/* Ring indexes: rows of the ringbuf_drops map, and the `ring` label. */
#define NETTAP_RING_CAPTURE_CHUNKS 0
#define NETTAP_RING_CAPTURE_EOF	   1
#define NETTAP_RING_LOGS	   2
#define NETTAP_RING_OBS_EVENTS	   3
#define NETTAP_RING_DLOPEN	   4
#define NETTAP_RING_SEGMENTS	   5
#define NETTAP_RING_DNS		   6
#define NETTAP_RING_COUNT	   7

/* Map indexes: rows of the map_insert_failures map, and the `map` label of
 * nettap_bpf_map_insert_failures_total: a map whose refused insert (full, or
 * no memory) loses what its entry was for. */
#define NETTAP_MAP_TLS_CALLS	0 /* a TLS call not followed: its plaintext not captured */
#define NETTAP_MAP_GO_TLS_CALLS 1 /* a Go TLS call of a task target not followed: not captured */
#define NETTAP_MAP_TIMEWAIT	2 /* a captured connection's TIME_WAIT socket not followed */
#define NETTAP_MAP_REQUESTS	3 /* a captured listener's request socket not followed */
#define NETTAP_MAP_LISTENERS	4 /* a captured listener whose dropped SYNs are not counted */
#define NETTAP_MAP_COUNT	5

/* Rows of the obs_counters per-CPU array: what captured sockets did, counted
 * in the kernel (before their records reach a ring that may be full). */
#define NETTAP_OBS_STATES   0	 /* + oldstate * 16 + newstate (TCP states are < 16) */
#define NETTAP_OBS_RESETS   256	 /* + NETTAP_DIR_* (egress: sent, ingress: received) */
#define NETTAP_OBS_ERRORS   264	 /* + the error number (1..254; 255: any larger) */
#define NETTAP_OBS_RETRANS  520	 /* + NETTAP_RETRANS_* */
#define NETTAP_OBS_TIMERS   528	 /* + NETTAP_TIMER_* * 16 + 0..15 (timer.bpf.h) */
#define NETTAP_OBS_WAKEUPS  576	 /* + NETTAP_WAKEUP_* */
#define NETTAP_OBS_SAMPLED  584	 /* sockets left out by capture.sample_connections */
#define NETTAP_OBS_TIMEWAIT 592	 /* + NETTAP_TW_*: TIME_WAIT sockets made, and ended by cause */
#define NETTAP_OBS_REQUESTS 600	 /* + NETTAP_REQ_*: request sockets made, and their outcomes */
#define NETTAP_OBS_ROWS	    1024 /* a power of two (obs_count masks with it) */

/* capture_config.flags: which kinds of capture target exist. */
#define NETTAP_TARGET_PID      (1U << 0)
#define NETTAP_TARGET_CGROUP   (1U << 1)
#define NETTAP_TARGET_NETNS    (1U << 2)
#define NETTAP_TARGET_PORT     (1U << 3)
#define NETTAP_TARGET_SEGMENTS (1U << 4) /* a target records its sockets' segments */

/* A target map's value (capture_pids, _cgroups, _netns, _port_kinds): what
 * it asks. This bit, and bit (1 << NETTAP_KIND_*) of each record kind its
 * sockets publish (its records:, else capture.records; conn.wants). */
#define NETTAP_MATCH_CAPTURE 1

/* Payload bytes in one chunk: sizeof(struct nettap_chunk) == 504, stride 512. */
#define NETTAP_CHUNK_DATA	   396
/* Hard bounds of one call's capture (the verifier needs them). */
#define NETTAP_MAX_CHUNKS_PER_CALL 166 /* 166 * 396 = 65736 >= 64 KiB */
#define NETTAP_MAX_IOV		   8
/* DNS message bytes one dns record holds (a classic UDP message's limit). */
#define NETTAP_DNS_DATA		   512
/* nettap_dns.transport: the IP protocol numbers */
#define NETTAP_TRANSPORT_TCP	   6
#define NETTAP_TRANSPORT_UDP	   17
/* cgroup v2 levels a cgroup target may sit at (bit n of cgroup_levels),
 * and how many distinct levels the targets may use at once. */
#define NETTAP_MAX_CGROUP_LEVEL	   31
#define NETTAP_MAX_CGROUP_LEVELS   4

#define NETTAP_DIR_EGRESS  0 /* sent by the local socket */
#define NETTAP_DIR_INGRESS 1 /* received by the local socket */

/* nettap_chunk.flags */
#define NETTAP_CHUNK_F_READ_FAILED (1U << 0) /* payload could not be read; zeroed */
#define NETTAP_CHUNK_F_NO_CONN	   (1U << 1) /* conn table full: conn_id 0, offsets unknown */
#define NETTAP_CHUNK_F_TLS	   (1U << 2) /* TLS plaintext: its own offsets */
#define NETTAP_CHUNK_F_GO	   (1U << 3) /* of Go's crypto/tls (with tls); else libssl's */

/* nettap_owner.via: how nettap learnt a captured socket's owner */
#define NETTAP_VIA_CONNECT    1 /* its connect, in the connecting task */
#define NETTAP_VIA_FIRST_CALL 2 /* its first captured send or receive */
#define NETTAP_VIA_ACCEPT     3 /* its accept, in the accepting task */

/* nettap_retransmit.cause: which of TCP's recoveries sent a segment again,
 * told by the retransmit timer's state then (bpf/retransmit.bpf.c) */
#define NETTAP_RETRANS_RTO    1 /* the retransmission timer fired: counts toward tcp_retries2 */
#define NETTAP_RETRANS_TLP    2 /* a tail loss probe: the loss probe timer fired */
#define NETTAP_RETRANS_FAST   3 /* loss recovery on ACKs or RACK's reordering timer */
#define NETTAP_RETRANS_SYNACK 4 /* a listener's SYN-ACK sent again (its request's timer) */

/* nettap_timer.timer: which of a captured socket's timers the wheel fired */
#define NETTAP_TIMER_RETRANSMIT 1 /* icsk_retransmit_timer: RTO, loss and zero-window probes */
#define NETTAP_TIMER_KEEPALIVE	2 /* a TCP socket's keepalive: sk_timer, or icsk_keepalive_timer */

/* nettap_timer.event: what the retransmit timer was armed for (the kernel's
 * ICSK_TIME_*, include/net/inet_connection_sock.h); 0 for a keepalive */
#define NETTAP_EVENT_NONE	 0 /* a keepalive timer's */
#define NETTAP_EVENT_RTO	 1 /* ICSK_TIME_RETRANS */
#define NETTAP_EVENT_PROBE0	 3 /* ICSK_TIME_PROBE0: a zero-window probe */
#define NETTAP_EVENT_LOSS_PROBE	 5 /* ICSK_TIME_LOSS_PROBE: a tail loss probe */
#define NETTAP_EVENT_REO_TIMEOUT 6 /* ICSK_TIME_REO_TIMEOUT: RACK's reordering timer */

/* nettap_probe.probe: which probe a captured socket's timer sent */
#define NETTAP_WAKEUP_WINDOW	1 /* a zero-window probe (the retransmit timer's PROBE0) */
#define NETTAP_WAKEUP_KEEPALIVE 2 /* a keepalive probe (the keepalive timer) */

/* nettap_timewait.event: a captured connection's TIME_WAIT socket made, or
 * how it ended (bpf/timewait.bpf.c tells the early ends by the kernel
 * function that killed it: inet_twsk_deschedule_put's caller) */
#define NETTAP_TW_MADE	    1 /* made as the connection closed, its timer started */
#define NETTAP_TW_EXPIRED   2 /* its timer fired: TIME_WAIT's 60 s, or tcp_fin_timeout half-closed */
#define NETTAP_TW_REUSED    3 /* a new connection took its tuple (a connect, tcp_tw_reuse; a SYN) */
#define NETTAP_TW_RESET	    4 /* a reset killed it: one received, or one it sent to new data */
#define NETTAP_TW_PURGED    5 /* its network namespace went away */
#define NETTAP_TW_KILLED    6 /* killed early by another path */
#define NETTAP_TW_FORGOTTEN 7 /* none: forgotten as a reload detached them (only counted) */

/* nettap_request.outcome: a captured listener's request socket (a SYN
 * received, its SYN-ACK sent) made, or how it ended (bpf/request.bpf.c) */
#define NETTAP_REQ_MADE	       1  /* made: a SYN received, a SYN-ACK sent */
#define NETTAP_REQ_ESTABLISHED 2  /* its handshake's ACK came: its socket made and queued */
#define NETTAP_REQ_TIMEOUT     3  /* no ACK after tcp_synack_retries SYN-ACKs sent again */
#define NETTAP_REQ_OVERFLOW    4  /* its ACK came while the accept queue was full, then timed out */
#define NETTAP_REQ_RESET       5  /* a reset (or a segment tcp_check_req refused) ended it */
#define NETTAP_REQ_CLOSED      6  /* its listener closed */
#define NETTAP_REQ_KILLED      7  /* ended by another path */
#define NETTAP_REQ_COOKIE      8  /* none: a socket made from a SYN cookie's ACK */
#define NETTAP_REQ_LISTEN_DROP 9  /* none: segments the listener dropped (only counted) */
#define NETTAP_REQ_FORGOTTEN   10 /* none: forgotten as a reload detached them (only counted) */

/* nettap_tls_handshake.outcome, from SSL_do_handshake's return: 1, 0, or
 * below 0 (an error, or a non-blocking socket's "want read/write": the
 * caller calls again) */
#define NETTAP_TLS_HS_DONE     1
#define NETTAP_TLS_HS_FAILED   2
#define NETTAP_TLS_HS_NOT_DONE 3

/* nettap_log.code */
// clang-format off
#define NETTAP_LOG_READ_USER_FAILED   1 /* arg0 = error, arg1 = length */
#define NETTAP_LOG_CONN_TABLE_FULL    2 /* arg0 = error */
#define NETTAP_LOG_INFLIGHT_FULL      3 /* arg0 = error */
#define NETTAP_LOG_IOV_TRUNCATED      4 /* arg0 = iovcnt, arg1 = bytes not captured */
#define NETTAP_LOG_PAYLOAD_UNREADABLE 5 /* arg0 = iov_iter type, arg1 = bytes moved:
					 * kernel buffers (sendfile, splice), no chunk */
// clang-format on

/* The one entry of the capture_config array map; user space rewrites it
 * whenever the capture targets change (no program reload). */
struct nettap_capture_config {
	__u32 flags;		  /* NETTAP_TARGET_* present */
	__u32 cgroup_levels;	  /* bit n: a cgroup target sits at level n */
	__u32 max_payload_bytes;  /* payload captured per call, <= 64 KiB */
	__u32 wakeup_bytes;	  /* capture_chunks: wake the reader once this much is pending */
	__u32 eof_wakeup_bytes;	  /* capture_eof: the same, for its own ring (a fraction
				   * of each ring's size: one threshold cannot fit both) */
	__u32 wakeup_check_bytes; /* capture_chunks: look at the ring's fill once a CPU
				   * has published this much since its last look (0: at
				   * every call) */
	__u32 obs_wakeup_bytes;	  /* obs_events: the wakeup threshold, as eof's */
	__u32 records;		  /* bit (1 << NETTAP_KIND_*): the record kinds asked for
				   * (capture.records); the others are not published */
	__u32 sample_threshold;	  /* capture.sample_connections N: a connection is kept when
				   * its tuple's hash is below 2^32 / N (0: every one) */
	__u32 sample_connections; /* N itself (1: every connection), for the owner record */
};

/* What user space found out about the kernel before load (section
 * .rodata.nettap: read-only once loaded, so the verifier prunes on it). */
struct nettap_kernel {
	__u32 has_ancestor_cgroup_id; /* bpf_get_current_ancestor_cgroup_id in tracing (5.14) */
	__u32 has_task_btf;	      /* bpf_get_current_task_btf in tracing (5.11) */
	__u32 has_bpf_loop;	      /* bpf_loop (5.17) */
	__u32 keep_inflight;	      /* hash maps allocate at run time (bpf_mem_alloc,
				       * 6.1): a compat thread's call entry stays
				       * between its calls (emit.bpf.h) */
};

/* Kernel functions a program compares with (bpf/timewait.bpf.c,
 * bpf/request.bpf.c): their addresses, [start, end) from /proc/kallsyms,
 * written by user space into section .data.ksyms before the programs that
 * read them are attached (exporter/kernel/ksyms.py); 0 where unknown. A
 * function's compiler clones (name.constprop.N, .isra.N, .part.N, .cold)
 * take slots of their own, so the slots outnumber the functions. */
#define NETTAP_KSYM_DESCHEDULE	4
#define NETTAP_KSYM_CALLERS	12
#define NETTAP_KSYM_REQ_CALLERS 12
struct nettap_ksyms {
	__u64 tw_timer_handler; /* a TIME_WAIT socket's timer function (0: its programs detached) */
	/* inet_twsk_deschedule_put, which kills one early: start, end */
	__u64 tw_deschedule[NETTAP_KSYM_DESCHEDULE * 2];
	/* its callers: start, end, and the NETTAP_TW_* they kill by (0: by its
	 * substate, tcp_v4_rcv's and tcp_v6_rcv's) */
	__u64 tw_callers[NETTAP_KSYM_CALLERS * 3];
	__u64 req_timer_handler; /* a request socket's timer function */
	/* the functions that end a request early, or make a socket from a SYN
	 * cookie: start, end, NETTAP_REQ_* */
	__u64 req_callers[NETTAP_KSYM_REQ_CALLERS * 3];
};

/* The obs_counters map's one per-CPU value: rows NETTAP_OBS_* (one lookup
 * reads them all; batched lookups of array maps came after Linux 5.10). */
struct nettap_obs_counters {
	__u64 rows[NETTAP_OBS_ROWS];
};

/* Per-probe counters: one per-CPU array row per probe. */
struct nettap_probe_counters {
	__u64 calls;
	__u64 returns;
	__u64 bytes;
	__u64 chunks;
};

/* Go's crypto/tls (bpf/gotls.bpf.c): where a tls.Conn's socket is, one row
 * of map go_tls_layout. Go's offsets, the same for every Go binary attached
 * (exporter/kernel/goelf.py refuses one that differs). */
struct nettap_go_layout {
	__u32 conn;	 /* tls.Conn.conn: a net.Conn (itab pointer, data pointer) */
	__u32 fd;	 /* the *netFD in net.TCPConn (TCPConn.conn.fd) */
	__u32 sysfd;	 /* the int Sysfd in net.netFD (netFD.pfd.Sysfd) */
	__u32 itab_hash; /* the concrete type's hash in runtime.itab */
};

/* The first bytes of every ring record. */
struct nettap_hdr {
	__u64 ts_ns;			/* CLOCK_MONOTONIC when the kernel made the record */
	__u64 conn_id;			/* nettap's id of the connection, 0 if none or unknown */
	__u32 kind NETTAP_JSON("kind"); /* NETTAP_KIND_*: written as the line's "type" */
	__u32 pid;			/* tgid of the process the record is about */
};

/* A socket's family and ports (host order), nested in every record about a
 * socket: its fields are the record's, in its line as the header's are. Where
 * one means more for a record, the record's member says so in its comment
 * ("sport: local port (0 before it is bound)"), and docs/records.md shows
 * that. Filled by read_addrs (conn.bpf.h). */
struct nettap_ports {
	__u16 family NETTAP_JSON("family"); /* AF_INET or AF_INET6 */
	__u16 sport;			    /* local port */
	__u16 dport;			    /* remote port */
};

/* A socket's addresses (4 bytes for AF_INET, the rest 0), nested as
 * nettap_ports is. 4-aligned, as every record has it, so that an IPv4
 * address is one store (read_addrs). */
struct nettap_addrs {
	__u8 saddr[16] NETTAP_JSON("addr"); /* local address */
	__u8 daddr[16] NETTAP_JSON("addr"); /* remote address */
} __attribute__((aligned(4)));

/* A socket's network namespace and addresses, nested as nettap_ports is,
 * where a record has them in this order. */
struct nettap_netns_addrs {
	__u32 netns; /* inode of the socket's network namespace */
	struct nettap_addrs addrs;
};

/* ring capture_chunks: one slice (<= NETTAP_CHUNK_DATA bytes) of one call;
 * ts_ns at the call's return, pid the caller's. */
struct NETTAP_RECORD("chunk", "capture_chunks") nettap_chunk {
	struct nettap_hdr h;
	__u64 offset;		   /* stream offset of data[0] in this direction */
	__u64 call_offset;	   /* stream offset of the call's first byte */
	__u32 call_len;		   /* bytes the call moved (its return value) */
	__u32 len;		   /* bytes of data[] that hold payload */
	__u32 tid;		   /* the thread that made the call */
	struct nettap_ports ports; /* sport: local port, host order; dport: remote port, host order */
	__u8 direction NETTAP_JSON("enum:NETTAP_DIR");	/* sent or received by the local socket */
	__u8 flags NETTAP_JSON("flags:NETTAP_CHUNK_F"); /* what the chunk lacks, and why */
	struct nettap_addrs addrs;	   /* saddr: local address: 4 bytes for AF_INET, rest 0 */
	char comm[16] NETTAP_JSON("text"); /* the calling thread's task name */
	__u8 data[NETTAP_CHUNK_DATA] NETTAP_JSON("base64:len"); /* len bytes of payload */
};

/* ring capture_eof: a captured connection reached TCP_CLOSE; ts_ns then (or
 * at the socket's destruction), pid the connection's (as its state records'). */
struct NETTAP_RECORD("eof", "capture_eof") nettap_eof {
	struct nettap_hdr h;
	__u64 start_ns;		   /* capture began: first state or first call */
	__u64 tx_bytes;		   /* bytes sent through captured calls */
	__u64 rx_bytes;		   /* bytes received through captured calls */
	__u64 tx_calls;		   /* captured send calls that moved bytes */
	__u64 rx_calls;		   /* captured receive calls that moved bytes */
	__u32 tid;		   /* thread that moved the socket to TCP_CLOSE */
	struct nettap_ports ports; /* sport: local port (0 once the kernel released it) */
	__u8 oldstate NETTAP_JSON("enum:tcp_state"); /* TCP state before TCP_CLOSE */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_addrs addrs;
	char comm[16] NETTAP_JSON("text"); /* task that moved the socket to TCP_CLOSE */
	__u32 established_us; /* from start_ns to ESTABLISHED: its handshake, where capture began
			       * at its first state (0: not seen established) */
};

/* ring obs_events: a captured socket changed TCP state (sock:inet_sock_set_state);
 * pid the connection's (its connect's or its first captured call's; 0 while
 * unknown: a passive socket is decided in softirq, by a socket target). */
struct NETTAP_RECORD("state", "obs_events") nettap_state {
	struct nettap_hdr h;
	struct nettap_ports ports;		     /* sport: local port (0 before it is bound) */
	__u8 oldstate NETTAP_JSON("enum:tcp_state"); /* the state it left */
	__u8 newstate NETTAP_JSON("enum:tcp_state"); /* the state it entered */
	struct nettap_addrs addrs;
	__u32 netns; /* inode of the socket's network namespace */
	__u32 pad0 NETTAP_JSON("-");
};

/* ring obs_events: a captured socket sent a reset (tcp:tcp_send_reset: an
 * abort, a close with unread data or SO_LINGER 0) or received one
 * (tcp:tcp_receive_reset); pid the connection's. */
struct NETTAP_RECORD("reset", "obs_events") nettap_reset {
	struct nettap_hdr h;
	struct nettap_ports ports;
	__u8 direction NETTAP_JSON("enum:NETTAP_DIR"); /* egress: sent; ingress: received */
	__u8 state NETTAP_JSON("enum:tcp_state");      /* the socket's state then */
	struct nettap_addrs addrs;
	__u32 netns; /* inode of the socket's network namespace */
	__u32 pad0 NETTAP_JSON("-");
};

/* ring obs_events: who owns a captured socket, once per connection, as soon
 * as nettap learns it: at its connect or its accept, else at its first
 * captured call; pid (the header's) is the owner's tgid. */
struct NETTAP_RECORD("owner", "obs_events") nettap_owner {
	struct nettap_hdr h;
	__u64 cgroup_id; /* the owner's cgroup v2 id (its directory's inode) */
	__u32 tid;	 /* the owner's thread that made the call */
	struct nettap_ports ports;
	__u8 via NETTAP_JSON("enum:NETTAP_VIA"); /* how nettap learnt the owner */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_netns_addrs at;
	char comm[16] NETTAP_JSON("text"); /* the owner's thread's task name */
	__u32 sample; /* 1 in sample connections captured (capture.sample_connections then) */
	__u32 pad1 NETTAP_JSON("-");
};

/* ring obs_events: a captured socket reported an error
 * (sock:inet_sk_error_report, Linux 5.14+: a refused or timed-out connect, a
 * reset, an ICMP error); pid the connection's. */
struct NETTAP_RECORD("error", "obs_events") nettap_error {
	struct nettap_hdr h;
	__u32 errno;				    /* the socket's error (sk_err), its number */
	__u32 errno_name NETTAP_JSON("enum:errno"); /* the same, by its name */
	struct nettap_ports ports;
	__u8 state NETTAP_JSON("enum:tcp_state"); /* the socket's state then */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_netns_addrs at;
};

/* ring obs_events: a captured socket was destroyed (tcp:tcp_destroy_sock),
 * with what the kernel counted for it over its life (struct tcp_sock; the
 * byte counts are sequence space, RFC 4898's ThruOctets: a SYN and a FIN
 * count one each, but Linux 5.10 does not count a FIN received); pid the
 * connection's. */
struct NETTAP_RECORD("destroy", "obs_events") nettap_destroy {
	struct nettap_hdr h;
	__u64 bytes_acked;    /* sent and acknowledged by the peer */
	__u64 bytes_received; /* received in sequence */
	__u32 segs_out;	      /* segments sent, retransmissions included */
	__u32 segs_in;	      /* segments received */
	__u32 total_retrans;  /* segments retransmitted */
	struct nettap_ports ports;
	__u8 state NETTAP_JSON("enum:tcp_state"); /* the socket's state then */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_netns_addrs at;
};

/* ring obs_events: a captured socket sent a segment again
 * (tcp:tcp_retransmit_skb); its cause tells the retransmission timer's
 * retransmissions (the only ones tcp_retries2 counts) from tail loss probes
 * and from loss recovery on ACKs; pid the connection's. */
struct NETTAP_RECORD("retransmit", "obs_events") nettap_retransmit {
	struct nettap_hdr h;
	__u32 rto_jiffies; /* the retransmission timeout then (icsk_rto) */
	__u32 srtt_us;	   /* the smoothed round-trip time then */
	struct nettap_ports ports;
	__u8 cause NETTAP_JSON("enum:NETTAP_RETRANS"); /* which recovery sent it */
	__u8 state NETTAP_JSON("enum:tcp_state");      /* the socket's state then */
	__u8 retransmits; /* timer retransmissions in a row before it (icsk_retransmits) */
	__u8 pad0[3] NETTAP_JSON("-");
	struct nettap_netns_addrs at;
};

/* ring obs_events: a listener sent a SYN-ACK again
 * (tcp:tcp_retransmit_synack): the connection is a request, not yet a
 * socket, so conn_id and pid are 0; captured by the socket targets (port,
 * netns) as a passive open is. */
struct NETTAP_RECORD("synack_retransmit", "obs_events") nettap_synack_retransmit {
	struct nettap_hdr h;
	struct nettap_ports
		ports; /* sport: local port: the listener's; dport: remote port: the connecting peer's */
	__u8 retransmits; /* SYN-ACKs sent again before it (num_retrans) */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_netns_addrs at; /* netns: inode of the listener's network namespace */
	__u8 pad1[4] NETTAP_JSON("-");
};

/* ring obs_events: the timer wheel fired a captured socket's retransmit or
 * keepalive timer (timer:timer_expire_entry), how late, and whether its
 * owner held the socket then (the timer then does nothing and tries again:
 * a keepalive HZ/20 later); pid the connection's. */
struct NETTAP_RECORD("timer", "obs_events") nettap_timer {
	struct nettap_hdr h;
	__u32 behind_jiffies; /* from its slot on the wheel to when its CPU fired it */
	__u32 late_jiffies;   /* from the expiry its owner set to its slot: the wheel's rounding */
	struct nettap_ports ports;
	__u8 timer NETTAP_JSON("enum:NETTAP_TIMER"); /* which timer */
	__u8 event NETTAP_JSON("enum:NETTAP_EVENT"); /* what the retransmit timer was armed for */
	__u8 owned;				     /* 1: its owner held the socket */
	__u8 state NETTAP_JSON("enum:tcp_state");    /* the socket's state then */
	__u8 pad0[2] NETTAP_JSON("-");
	struct nettap_netns_addrs at;
};

/* ring obs_events: a captured socket's timer sent a probe
 * (tcp_write_wakeup): a zero-window probe to a peer that advertised no
 * room, or a keepalive probe to an idle peer; told as the timer's function
 * returns (timer:timer_expire_exit) by icsk_probes_out having grown. A
 * probe sent when the owner releases a socket it held as the timer fired
 * is not seen. pid the connection's. */
struct NETTAP_RECORD("probe", "obs_events") nettap_probe {
	struct nettap_hdr h;
	__u32 snd_wnd;	   /* the window the peer last advertised */
	__u32 rto_jiffies; /* the retransmission timeout then (icsk_rto) */
	struct nettap_ports ports;
	__u8 probe NETTAP_JSON("enum:NETTAP_WAKEUP"); /* which probe */
	__u8 probes_out; /* probes sent with no answer, this one included */
	__u8 state NETTAP_JSON("enum:tcp_state"); /* the socket's state then */
	__u8 pad0[3] NETTAP_JSON("-");
	struct nettap_netns_addrs at;
};

/* ring obs_events: a captured connection's TIME_WAIT socket (struct
 * inet_timewait_sock, which takes the connection's tuple over as its socket
 * closes) made or ended (bpf/timewait.bpf.c); conn_id and pid the
 * connection's, whose socket is gone by its end. */
struct NETTAP_RECORD("timewait", "obs_events") nettap_timewait {
	struct nettap_hdr h;
	__u32 timeout_jiffies; /* made: until its timer fires; ended: what was left then (0: none) */
	__u32 age_ms;	       /* ended: since it was made; made: 0 */
	struct nettap_ports ports;
	__u8 event NETTAP_JSON("enum:NETTAP_TW");    /* made, or how it ended */
	__u8 substate NETTAP_JSON("enum:tcp_state"); /* TIME_WAIT, or FIN_WAIT2: closed by this
						      * end, the peer's FIN not yet come */
	struct nettap_netns_addrs at;
	__u8 pad0[4] NETTAP_JSON("-");
};

/* ring obs_events: a request socket of a captured listener (a port or netns
 * target, as a passive open is decided) made or ended (bpf/request.bpf.c);
 * no connection yet: conn_id and pid 0. */
struct NETTAP_RECORD("request", "obs_events") nettap_request {
	struct nettap_hdr h;
	__u32 timeout_jiffies; /* made: until its timer first fires; ended: what was left then */
	__u32 age_ms;	       /* ended: since it was made; made: 0 */
	struct nettap_ports
		ports; /* sport: local port: the listener's; dport: remote port: the connecting peer's */
	__u8 outcome NETTAP_JSON("enum:NETTAP_REQ"); /* made, or how it ended */
	__u8 retransmits;			     /* SYN-ACKs sent again (num_retrans) */
	struct nettap_netns_addrs at; /* netns: inode of the listener's network namespace */
	__u8 pad0[4] NETTAP_JSON("-");
};

/* ring segments: a segment an established captured socket received
 * (tcp:tcp_probe, before TCP processes it), with the socket's congestion
 * state then; only for sockets of a target with segments on. */
struct NETTAP_RECORD("segment", "segments") nettap_segment {
	struct nettap_hdr h;
	__u32 seq;	/* the segment's sequence number */
	__u32 length;	/* its payload bytes */
	__u32 snd_cwnd; /* the congestion window, in segments */
	__u32 ssthresh; /* the slow-start threshold, in segments */
	__u32 srtt_us;	/* the smoothed round-trip time */
	__u32 snd_wnd;	/* the window the peer advertised */
	__u32 rcv_wnd;	/* the window this socket advertised */
	struct nettap_ports ports;
	__u16 segs; /* segments it stands for (tcpi_segs_in): >1 where the kernel joined them */
	struct nettap_netns_addrs at;
};

/* ring obs_events: a TLS handshake on a captured socket (libssl's
 * SSL_do_handshake, from its call to its return; its socket learnt as for
 * TLS chunks: tls.bpf.h); pid the calling process's. A handshake libssl
 * makes inside a first SSL_read or SSL_write is not seen. */
struct NETTAP_RECORD("tls_handshake", "obs_events") nettap_tls_handshake {
	struct nettap_hdr h;
	__u64 duration_ns; /* from the call to its return */
	__u32 tid;	   /* the calling thread */
	struct nettap_ports ports;
	__u8 outcome NETTAP_JSON("enum:NETTAP_TLS_HS"); /* what SSL_do_handshake returned */
	__u8 pad0 NETTAP_JSON("-");
	struct nettap_netns_addrs at;
	char comm[16] NETTAP_JSON("text"); /* the calling thread's task name */
};

/* ring dlopen: a process mapped a libssl file to run it (mmap with
 * PROT_EXEC: the dynamic linker at exec or at dlopen), or ran a program
 * (execve: Go's crypto/tls is in the executable), while capture.tls is on;
 * pid the process's. User space attaches the TLS uprobes to that file if it
 * has not yet (exporter/kernel/tlsfiles.py). */
struct NETTAP_RECORD("dlopen", "dlopen") nettap_dlopen {
	struct nettap_hdr h;
	__u64 ino;			   /* the file's inode number */
	__u32 dev;			   /* its file system's device, (major << 20) | minor */
	__u32 tid;			   /* the mapping thread */
	char comm[16] NETTAP_JSON("text"); /* the mapping thread's task name */
	char name[16] NETTAP_JSON(
		"text"); /* the file's name, no directory (libssl.so.*, a program) */
};

/* ring dns: a DNS message a captured workload sent to UDP port 53, or received
 * from a server it sent one to, or the bytes of one call on its TCP connection
 * to port 53 (messages there are framed by a 2-byte length: user space
 * reassembles them), at its syscall (bpf/dns.bpf.c); pid the caller's,
 * conn_id 0 (sock_ino names the socket). */
struct NETTAP_RECORD("dns", "dns") nettap_dns {
	struct nettap_hdr h;
	__u64 sock_ino;		   /* the socket's inode: socket:[N] in /proc/PID/fd */
	__u32 size;		   /* bytes the call moved (asked to send, or received) */
	__u32 len;		   /* bytes of data[] that hold its first bytes */
	__u32 tid;		   /* the calling thread */
	__u32 netns;		   /* inode of the socket's network namespace */
	struct nettap_ports ports; /* dport: the peer's port (53) */
	__u8 direction NETTAP_JSON("enum:NETTAP_DIR");	     /* egress: sent; ingress: received */
	__u8 flags NETTAP_JSON("flags:NETTAP_CHUNK_F");	     /* read_failed: data zeroed */
	__u8 transport NETTAP_JSON("enum:NETTAP_TRANSPORT"); /* udp: a message; tcp: stream bytes */
	__u8 pad0[7] NETTAP_JSON("-");
	struct nettap_addrs addrs;			      /* daddr: the peer's address */
	char comm[16] NETTAP_JSON("text");		      /* the calling thread's task name */
	__u8 data[NETTAP_DNS_DATA] NETTAP_JSON("base64:len"); /* the call's first len bytes */
};

/* ring logs: a problem met by a BPF program; pid the calling process's,
 * conn_id the call's connection where known. */
struct NETTAP_RECORD("log", "logs") nettap_log {
	struct nettap_hdr h;
	__u32 code NETTAP_JSON("enum:NETTAP_LOG");    /* what went wrong */
	__u32 probe NETTAP_JSON("enum:NETTAP_PROBE"); /* the probe that met it */
	__u64 arg0;				      /* the code's first detail */
	__u64 arg1;				      /* the code's second detail */
	__u32 tid;				      /* the calling thread */
	char comm[16] NETTAP_JSON("text");	      /* the calling thread's task name */
	__u8 pad0[4] NETTAP_JSON("-");
};

#endif /* NETTAP_TCP_H */
