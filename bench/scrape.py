#!/usr/bin/env python3
"""Scrape cost: one /metrics rendering with BPF statistics on, node-wide
scope, and 200 extra programs loaded on the node, beside an empty-registry
rendering measured in the same run, by nettap's text renderer (what the
endpoint runs: exporter/web/exposition.py) and by the client library's
generate_latest (what it replaced); and the node walk alone: by the BPF
iterator (exporter/kernel/nodewalk.py, scope node's walk where the kernel
offers it), by the compiled bpf(2) walk (exporter/kernel/_native.c, the
fallback), and by one ctypes call per bpf(2) call (what that replaced).

Run as root:  .venv/bin/python bench/scrape.py [--programs 200] [--scrapes 200]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from exporter import config  # noqa: E402
from exporter.kernel import bpfstats, libbpf, nodewalk  # noqa: E402
from exporter.web.exposition import TextRenderer  # noqa: E402
from exporter.commands.daemon import Nettap  # noqa: E402

BPF_PROG_TYPE_SOCKET_FILTER = 1


def load_extra(n: int) -> list:
    """n two-instruction socket filters, held open by this process."""
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)    # r0 = 0; exit
    fds = []
    for i in range(n):
        fd = libbpf.lib().bpf_prog_load(BPF_PROG_TYPE_SOCKET_FILTER, f"bench_{i}".encode(), b"GPL",
                                        insns, 2, None)
        if fd < 0:
            raise OSError(-fd, "bpf_prog_load")
        fds.append(fd)
    return fds


def ctypes_walk() -> list:
    """The node's programs by one ctypes call per bpf(2) call: next id, fd by
    id, info, close (nettap's walk before the compiled one)."""
    lb = libbpf.lib()
    info, n, cur, out = bpfstats.bpf_prog_info(), ctypes.c_uint32(), ctypes.c_uint32(0), []
    size = ctypes.sizeof(info)
    while lb.bpf_prog_get_next_id(cur.value, ctypes.byref(cur)) == 0:
        fd = lb.bpf_prog_get_fd_by_id(cur.value)
        if fd < 0:
            continue
        ctypes.memset(ctypes.byref(info), 0, size)
        n.value = size
        if lb.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(n)) == 0:
            out.append((info.id, info.name, info.type, info.run_cnt, info.run_time_ns))
        os.close(fd)
    return out


def _renderer(registry):
    """What the endpoint runs for a text-format scrape of registry."""
    render = TextRenderer().render
    return lambda: render(registry)


def timed(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--scrapes", type=int, default=200)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    extra = load_extra(a.programs)
    app = Nettap(config.parse({"captures": [{"port": 1}], "output": {"type": "none"},
                               "diagnostics": {"bpfStats": {"enabled": True, "scope": "node"}}}))
    try:
        empty = CollectorRegistry()
        reg = app.registry()
        text = generate_latest(reg).decode()
        nodes = sum(1 for l in text.splitlines() if l.startswith("nettap_node_bpf_program_runs_total"))
        base = timed(lambda: generate_latest(empty), a.scrapes)
        full_lib = timed(lambda: generate_latest(reg), a.scrapes)
        full = timed(_renderer(reg), a.scrapes)
        own = app.registry()
        app.config = config.parse({"captures": [{"port": 1}], "output": {"type": "none"},
                                   "diagnostics": {"bpfStats": {"enabled": True, "scope": "own"}}})
        own_lib = timed(lambda: generate_latest(own), a.scrapes)
        own_t = timed(_renderer(own), a.scrapes)
        walk = timed(bpfstats.node_programs, a.scrapes)
        walk_ctypes = timed(ctypes_walk, a.scrapes)
        how = app.node_walk.mechanism
        walk_iter = timed(lambda: bpfstats.node_programs(None, app.node_walk.programs), a.scrapes)
        walked = len(bpfstats.node_programs())
    finally:
        app.close()
        for fd in extra:
            os.close(fd)
    print(f"\nnettap scrape benchmark (median of {a.scrapes}; {a.programs} extra programs loaded, "
          f"{nodes} node-program series, {len(text.splitlines())} lines)\n")
    print(f"empty registry                      {base * 1e3:8.3f} ms")
    print(f"nettap, bpfStats on, scope own      {own_t * 1e3:8.3f} ms   (client library's rendering: "
          f"{own_lib * 1e3:.3f} ms)")
    print(f"nettap, bpfStats on, scope node     {full * 1e3:8.3f} ms   (client library's rendering: "
          f"{full_lib * 1e3:.3f} ms; goal: <= 2.5 ms)")
    print(f"\nthe node walk alone ({walked} programs; scope node's walk here: {how})")
    if how == "iterator":
        print(f"  BPF iterator (one read)           {walk_iter * 1e3:8.3f} ms   "
              f"({walk_iter / walked * 1e6:.2f} us a program)")
    else:
        print(f"  BPF iterator                      not offered ({nodewalk.iterator_offered()[1]})")
    print(f"  compiled (one call)               {walk * 1e3:8.3f} ms   ({walk / walked * 1e6:.2f} us a program)")
    print(f"  ctypes (one call per bpf(2) call) {walk_ctypes * 1e3:8.3f} ms   "
          f"({walk_ctypes / walked * 1e6:.2f} us a program)")


if __name__ == "__main__":
    main()
