#!/usr/bin/env python3
"""Scrape cost: one /metrics rendering with BPF statistics on, node-wide
scope, and 100 extra programs loaded on the node, beside an empty-registry
rendering measured in the same run.

Run as root:  .venv/bin/python bench/scrape.py [--programs 100] [--scrapes 200]
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
from exporter.kernel import libbpf
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


def timed(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=100)
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
        full = timed(lambda: generate_latest(reg), a.scrapes)
        own = app.registry()
        app.config = config.parse({"captures": [{"port": 1}], "output": {"type": "none"},
                                   "diagnostics": {"bpfStats": {"enabled": True, "scope": "own"}}})
        own_t = timed(lambda: generate_latest(own), a.scrapes)
    finally:
        app.close()
        for fd in extra:
            os.close(fd)
    print(f"\nnettap scrape benchmark (median of {a.scrapes}; {a.programs} extra programs loaded, "
          f"{nodes} node-program series, {len(text.splitlines())} lines)\n")
    print(f"empty registry                      {base * 1e3:8.3f} ms")
    print(f"nettap, bpfStats on, scope own      {own_t * 1e3:8.3f} ms")
    print(f"nettap, bpfStats on, scope node     {full * 1e3:8.3f} ms   (goal: <= 5 ms)")


if __name__ == "__main__":
    main()
