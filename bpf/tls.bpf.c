// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tls.bpf.c: uprobes on libssl's SSL_write, SSL_write_ex, SSL_read,
 * SSL_read_ex and SSL_do_handshake, and on SSL_free and SSL_clear (OpenSSL
 * 1.1.1 and 3.x), attached by user space to every libssl file it finds (exporter/kernel/tls.py). The plaintext is published
 * at the return, as chunks flagged NETTAP_CHUNK_F_TLS of the socket's
 * connection (tls.bpf.h says how the socket is known), with offsets of
 * their own: a retried or partial write publishes what it wrote, once.
 */
#include "emit.bpf.h"
#include <bpf/bpf_tracing.h>

#define EEXIST 17

static __always_inline int tls_enter(__u32 probe, __u64 ssl, __u64 buf, __u64 outp, __u32 ex)
{
	struct nettap_capture_config *cfg = active_config();
	__u64 id = bpf_get_current_pid_tgid();
	struct tls_key key = { .pid_tgid = id, .probe = probe };
	struct tls_call call = { .ssl = ssl, .buf = buf, .outp = outp, .ex = ex };
	long err;

	if (!cfg)
		return 0;
	/* Only task targets: a task they do not name is never captured. */
	if (!(cfg->flags & (NETTAP_TARGET_PORT | NETTAP_TARGET_NETNS)) && !task_matches(cfg))
		return 0;
	if (probe == NETTAP_PROBE_SSL_HANDSHAKE)
		call.start_ns = bpf_ktime_get_ns();
	err = bpf_map_update_elem(&tls_calls, &key, &call, BPF_NOEXIST);
	if (!err)
		__sync_fetch_and_add(tls_slot(id), 1);
	else if (err == -EEXIST) /* left by a return that never ran (longjmp), or TLS
				  * inside TLS: the inner call */
		bpf_map_update_elem(&tls_calls, &key, &call, BPF_EXIST);
	else /* full, or no memory: this call is not followed */
		count_insert_failure(NETTAP_MAP_TLS_CALLS);
	return 0;
}

/* The thread's call of probe returned: its state taken (and removed), its
 * socket known (learnt inside it, or earlier for its SSL object while that
 * socket's connection lasts) and still a target's, cn its connection (NULL
 * when the table had no room for it); false otherwise. */
static __always_inline bool tls_take(__u32 probe, struct tls_call *call, struct conn **cn,
				     struct nettap_capture_config **cfg, const bool fast)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct tls_key key = { .pid_tgid = id, .probe = probe };
	struct tls_sock_key skey = {};
	struct tls_sock *known, learnt;
	struct tls_call *f;
	struct sock *sk;

	if (!*tls_slot(id))
		return false;
	f = bpf_map_lookup_elem(&tls_calls, &key);
	if (!f)
		return false;
	*call = *f;
	bpf_map_delete_elem(&tls_calls, &key);
	__sync_fetch_and_add(tls_slot(id), -1);
	skey.ssl = call->ssl;
	skey.tgid = id >> 32;
	if (call->sk) {
		*cn = bpf_map_lookup_elem(&capture_conns, &call->sk);
		if (*cn) {
			learnt.sk = call->sk;
			learnt.conn_id = (*cn)->id;
			bpf_map_update_elem(&tls_socks, &skey, &learnt, BPF_ANY);
		} else { /* no connection to tie it to: nothing kept */
			bpf_map_delete_elem(&tls_socks, &skey);
		}
	} else {
		/* No TCP call inside: served from libssl's buffer, or not captured. */
		known = bpf_map_lookup_elem(&tls_socks, &skey);
		if (!known)
			return false;
		call->sk = known->sk;
		*cn = bpf_map_lookup_elem(&capture_conns, &call->sk);
		if (!*cn || (*cn)->id != known->conn_id) {
			/* its connection ended (or the address is another's now) */
			bpf_map_delete_elem(&tls_socks, &skey);
			return false;
		}
	}
	*cfg = active_config();
	if (!*cfg)
		return false;
	sk = fast ? KCAST(struct sock, call->sk) : (struct sock *)call->sk;
	/* The targets may have changed since the socket was learnt. */
	return task_matches(*cfg) || sock_matches(*cfg, sk, fast);
}

static __always_inline int tls_exit(__u32 probe, long ret, const bool fast)
{
	struct nettap_capture_config *cfg = NULL;
	struct tls_call call = {};
	struct conn *cn = NULL;
	__u64 bytes = 0;

	if (!tls_take(probe, &call, &cn, &cfg, fast) || !cfg)
		return 0;
	if (call.ex) {
		if (ret == 1 && call.outp)
			bpf_probe_read_user(&bytes, sizeof(bytes), (void *)call.outp);
	} else if (ret > 0) {
		bytes = ret;
	}
	tls_publish(cfg, probe, call.sk, cn, call.buf, bytes, NETTAP_CHUNK_F_TLS, fast);
	return 0;
}

/* ring obs_events: a handshake's duration and outcome. */
static __always_inline int tls_handshake_exit(long ret, const bool fast)
{
	struct nettap_capture_config *cfg = NULL;
	struct nettap_probe_counters *c;
	struct nettap_tls_handshake *r;
	struct tls_call call = {};
	struct conn *cn = NULL;
	struct sock *sk;
	__u64 id;

	if (!tls_take(NETTAP_PROBE_SSL_HANDSHAKE, &call, &cn, &cfg, fast))
		return 0;
	c = counters(NETTAP_PROBE_SSL_HANDSHAKE);
	if (c) {
		__sync_fetch_and_add(&c->calls, 1);
		__sync_fetch_and_add(&c->returns, 1);
	}
	if (!conn_wants(cfg, cn, NETTAP_KIND_TLS_HANDSHAKE))
		return 0;
	r = bpf_ringbuf_reserve(&obs_events, sizeof(*r), 0);
	if (!r) {
		count_drop(NETTAP_RING_OBS_EVENTS, 1);
		return 0;
	}
	id = bpf_get_current_pid_tgid();
	r->h.ts_ns = bpf_ktime_get_ns();
	r->h.conn_id = cn ? cn->id : 0;
	r->h.kind = NETTAP_KIND_TLS_HANDSHAKE;
	r->h.pid = id >> 32;
	r->duration_ns = r->h.ts_ns - call.start_ns;
	r->tid = (__u32)id;
	r->outcome = ret == 1	? NETTAP_TLS_HS_DONE
		     : ret == 0 ? NETTAP_TLS_HS_FAILED
				: NETTAP_TLS_HS_NOT_DONE;
	r->pad0 = 0;
	sk = fast ? KCAST(struct sock, call.sk) : (struct sock *)call.sk;
	OBS_SOCK(r, sk, fast);
	bpf_get_current_comm(r->comm, sizeof(r->comm));
	obs_submit(r);
	return 0;
}

#define NETTAP_TLS_ENTRY(name, probe, ex, tag)                                             \
	NETTAP_PROG(tag " mech=uprobe")                                                    \
	SEC("uprobe")                                                                      \
	int BPF_KPROBE(name, void *ssl, void *buf, __u64 num, void *outp)                  \
	{                                                                                  \
		return tls_enter(probe, (__u64)ssl, (__u64)buf, ex ? (__u64)outp : 0, ex); \
	}

/* One entry program per symbol (the plain and _ex calls differ in what they
 * return), one return program per direction and variant. */
NETTAP_TLS_ENTRY(ssl_write_enter, NETTAP_PROBE_SSL_WRITE, 0, "probe=ssl_write attach=SSL_write")
NETTAP_TLS_ENTRY(ssl_write_ex_enter, NETTAP_PROBE_SSL_WRITE, 1,
		 "probe=ssl_write attach=SSL_write_ex")
NETTAP_TLS_ENTRY(ssl_read_enter, NETTAP_PROBE_SSL_READ, 0, "probe=ssl_read attach=SSL_read")
NETTAP_TLS_ENTRY(ssl_read_ex_enter, NETTAP_PROBE_SSL_READ, 1, "probe=ssl_read attach=SSL_read_ex")

#define NETTAP_TLS_EXIT(name, probe, tag)              \
	NETTAP_PROG(tag " mech=uprobe variant=fast")   \
	SEC("uretprobe")                               \
	int BPF_KRETPROBE(name, int ret)               \
	{                                              \
		return tls_exit(probe, ret, FAST);     \
	}                                              \
	NETTAP_PROG(tag " mech=uprobe variant=compat") \
	SEC("uretprobe")                               \
	int BPF_KRETPROBE(name##_compat, int ret)      \
	{                                              \
		return tls_exit(probe, ret, COMPAT);   \
	}

NETTAP_TLS_EXIT(ssl_write_exit, NETTAP_PROBE_SSL_WRITE,
		"probe=ssl_write attach=SSL_write,SSL_write_ex")
NETTAP_TLS_EXIT(ssl_read_exit, NETTAP_PROBE_SSL_READ, "probe=ssl_read attach=SSL_read,SSL_read_ex")

NETTAP_PROG("probe=ssl_handshake mech=uprobe attach=SSL_do_handshake")
SEC("uprobe")
int BPF_KPROBE(ssl_handshake_enter, void *ssl)
{
	return tls_enter(NETTAP_PROBE_SSL_HANDSHAKE, (__u64)ssl, 0, 0, 0);
}

NETTAP_PROG("probe=ssl_handshake mech=uprobe variant=fast attach=SSL_do_handshake")
SEC("uretprobe")
int BPF_KRETPROBE(ssl_handshake_exit, int ret)
{
	return tls_handshake_exit(ret, FAST);
}

NETTAP_PROG("probe=ssl_handshake mech=uprobe variant=compat attach=SSL_do_handshake")
SEC("uretprobe")
int BPF_KRETPROBE(ssl_handshake_exit_compat, int ret)
{
	return tls_handshake_exit(ret, COMPAT);
}

/* SSL_free, and SSL_clear (an object reset for another connection; SSL_new
 * calls it too), in every process that maps libssl: the object's socket is
 * forgotten (tls_socks), so an SSL object that the allocator puts at a freed
 * one's address, or one reused, never takes the old connection's identity.
 * Attached before the calls' probes (exporter/kernel/tls.py). */
NETTAP_PROG("probe=ssl_write,ssl_read,ssl_handshake mech=uprobe attach=SSL_free,SSL_clear")
SEC("uprobe")
int BPF_KPROBE(ssl_free, void *ssl)
{
	struct tls_sock_key skey = { .ssl = (__u64)ssl, .tgid = bpf_get_current_pid_tgid() >> 32 };

	bpf_map_delete_elem(&tls_socks, &skey);
	return 0;
}

/* ring dlopen: a libssl file mapped to run (mmap(2) with PROT_EXEC of a
 * file the name of which starts with "libssl.so": the dynamic linker maps
 * each library so, at exec and at dlopen). Attached only while capture.tls
 * is on; the integer tests end nearly every mmap at once. */
#define PROT_EXEC 4
#define LIBSSL	  "libssl.so"

NETTAP_PROG("probe=ssl_write,ssl_read,ssl_handshake mech=tracepoint")
SEC("tracepoint/syscalls/sys_enter_mmap")
int tls_mmap(struct trace_event_raw_sys_enter *ctx)
{
	struct nettap_capture_config *cfg;
	struct file *file;
	char name[sizeof(LIBSSL)] = {};

	if (!(ctx->args[2] & PROT_EXEC) || (long)(int)ctx->args[4] < 0)
		return 0;
	cfg = active_config();
	if (!cfg)
		return 0;
	if (!(cfg->flags & (NETTAP_TARGET_PORT | NETTAP_TARGET_NETNS)) && !task_matches(cfg))
		return 0;
	file = fd_to_file(ctx->args[4], false);
	if (!file)
		return 0;
	bpf_probe_read_kernel(name, sizeof(name) - 1,
			      BPF_CORE_READ(file, f_path.dentry, d_name.name));
#pragma unroll
	for (int i = 0; i < sizeof(LIBSSL) - 1; i++)
		if (name[i] != LIBSSL[i])
			return 0;
	dlopen_submit(file);
	return 0;
}
