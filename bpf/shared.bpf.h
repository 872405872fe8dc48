/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * shared.bpf.h: the maps and globals the probe families share, defined once.
 * Each family (calls.bpf.c, ...) is its own compilation unit, and `bpftool gen
 * object` links them into tcp.bpf.o (bpf/Makefile). A shared header's map or
 * global is written `NETTAP_SHARED <type> name NETTAP_INIT(value)`: a definition
 * in the unit built with -DNETTAP_DATA_OWNER (tcp.bpf.c, linked first: the
 * linker wants a definition before its externs), an extern declaration in the
 * others, which the linker resolves to it.
 */
#ifndef NETTAP_SHARED_BPF_H
#define NETTAP_SHARED_BPF_H

#ifdef NETTAP_DATA_OWNER
#define NETTAP_SHARED
#define NETTAP_INIT(...) = __VA_ARGS__
#else
#define NETTAP_SHARED extern
#define NETTAP_INIT(...)
#endif

#endif /* NETTAP_SHARED_BPF_H */
