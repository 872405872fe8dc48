#!/usr/bin/env python3
"""Kernel cost of nettap's programs, in ns per run, from the kernel's own
BPF statistics, beside a baseline measured in the same run: empty programs
on the same tracepoints (what running any BPF program there costs).

  filtered out   sends on a port nettap does not capture (the common case:
                 the seed saw 30,000 filtered runs per captured one)
  captured       sends of 64 bytes on a captured port (one chunk each)

Run as root:  .venv/bin/python bench/probe_cost.py [--sends 200000]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from exporter import config, libbpf, loader  # noqa: E402
from exporter.app import Nettap  # noqa: E402
from exporter.bpfstats import StatsSwitch, own_program_stats  # noqa: E402
from traffic import Server  # noqa: E402


def sends(port: int, n: int) -> None:
    code = (f"import socket\ns=socket.socket(); s.connect(('127.0.0.1',{port}))\n"
            f"m=b'x'*64\nfor i in range({n}): s.send(m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def delta(after, before):
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def ns(d, name):
    runs, t = d[name]
    return t / runs if runs else float("nan")


def empty_programs(tmp: str):
    """Build, load and attach bench/empty.bpf.c; returns (obj, links, fds)."""
    obj_path = os.path.join(tmp, "empty.bpf.o")
    subprocess.run(["clang", "-g", "-O2", "-target", "bpf", "-I", "/usr/include", "-c",
                    os.path.join(ROOT, "bench/empty.bpf.c"), "-o", obj_path], check=True)
    obj = libbpf.call_ptr("bpf_object__open_file", obj_path.encode(), None)
    libbpf.call("bpf_object__load", obj)
    links, fds = [], {}
    for name in ("empty_enter", "empty_exit"):
        p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
        links.append(libbpf.call_ptr("bpf_program__attach", p))
        fds[name] = libbpf.call("bpf_program__fd", p)
    return obj, links, fds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sends", type=int, default=200000)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    loader.ensure_tracefs()
    captured, other = Server(), Server()
    switch = StatsSwitch()
    switch.set(True)
    app = Nettap(config.parse({"captures": [{"port": captured.port}], "output": {"type": "none"}}))
    obj, links, efds = empty_programs(tempfile.mkdtemp(prefix="nettap-bench-"))
    fds = dict(app.probes.prog_fds, **efds)
    rows = {}
    try:
        for case, port in (("filtered out", other.port), ("captured", captured.port)):
            before = own_program_stats(fds)
            sends(port, a.sends)
            rows[case] = delta(own_program_stats(fds), before)
    finally:
        for l in links:
            libbpf.lib().bpf_link__destroy(l)
        libbpf.lib().bpf_object__close(obj)
        app.close()
        switch.close()
    print(f"\nnettap probe cost (ns per run, kernel BPF statistics; {a.sends:,} 64-byte sends per case, "
          f"kernel {os.uname().release})\n")
    print(f"{'':14s} {'empty program':>14s} {'tcp_sendmsg_enter':>18s} {'tcp_sendmsg_exit':>17s}")
    for case, d in rows.items():
        print(f"{case:14s} {ns(d, 'empty_enter'):14.0f} {ns(d, 'tcp_sendmsg_enter'):18.0f} "
              f"{ns(d, 'tcp_sendmsg_exit'):17.0f}")
    print("\n(empty program: the same tracepoints with a program that returns at once; "
          "the exit program of a filtered-out call only looks up the task's in-flight slot)")


if __name__ == "__main__":
    main()
