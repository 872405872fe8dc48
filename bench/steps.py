#!/usr/bin/env python3
"""What each step of a timer program's "no" costs on this machine: programs
that do one step each (bench/steps.bpf.c) on timer:timer_start, for the
timers of n connections closed client first (bench/probe_cost.py's closing
case), in ns per run (kernel BPF statistics), beside an empty program. A
lead program is attached first: the first program on a tracepoint pays
more than the others (the table shows it), which is not its own cost.

Run as root:  .venv/bin/python bench/steps.py [--connections 2000] [--rounds 3] [--beside-nettap]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import probe_cost as pc  # noqa: E402
from exporter.kernel import arch, libbpf, mechanisms  # noqa: E402
from exporter.kernel.bpfstats import StatsSwitch, own_program_stats  # noqa: E402

# nettap's programs on the same tracepoint (--beside-nettap), fast variant
BESIDE = ("tcp_timewait", "tcp_request")
STEPS = {"step_lead": "the lead (attached first)", "step_empty": "empty",
         "step_function": "the timer's function against a constant",
         "step_function_global": "the timer's function against a global",
         "step_probe_read": "one bpf_probe_read_kernel (4 B)"}


def build(tmp: str) -> str:
    out = os.path.join(tmp, "steps.bpf.o")
    subprocess.run(["clang", "-g", "-O2", "-target", "bpf", f"-D__TARGET_ARCH_{arch.target()}", "-I", "/usr/include",
                    "-c", os.path.join(pc.ROOT, "bench/steps.bpf.c"), "-o", out], check=True)
    return out


def measure(obj_path: str, connections: int, rounds: int, beside: bool = False) -> list:
    """[{program: (runs, ns)}] a round; beside: nettap loaded after the lead
    (its TIME_WAIT and request records asked for, another port captured),
    its programs on timer:timer_start measured too."""
    obj = libbpf.call_ptr("bpf_object__open_file", obj_path.encode(), None)
    links, fds, out, app = [], {}, [], None
    try:
        libbpf.call("bpf_object__load", obj)
        for name in STEPS:                      # the lead first
            if name != "step_lead" and beside and app is None:
                app = pc.Nettap(pc.config.parse({"captures": [{"port": pc.free_port()}], "output": {"type": "none"},
                                                 "capture": {"records": ["timewait", "request"]}}))
                fds.update({f"nettap {n}": app.probes.prog_fds[n] for n in BESIDE})
            p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
            links.append(libbpf.call_ptr("bpf_program__attach", p))
            fds[name] = libbpf.call("bpf_program__fd", p)
        server = pc.Server()
        for _ in range(rounds):
            before = own_program_stats(fds)
            pc.closings(server.port, connections)
            time.sleep(0.5)
            d = pc.delta(own_program_stats(fds), before)
            out.append({name: (d[name][0], pc.ns(d, name)) for name in fds})
    finally:
        for link in links:
            libbpf.lib().bpf_link__destroy(link)
        libbpf.lib().bpf_object__close(obj)
        if app:
            app.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=2000, help="connections closed client first, a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--beside-nettap", action="store_true",
                    help="nettap loaded too, after the lead: its programs' rows beside the steps'")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: it loads BPF programs")
    mechanisms.ensure_tracefs()
    switch = StatsSwitch()
    switch.set(True)
    try:
        rounds = measure(build(tempfile.mkdtemp(prefix="nettap-steps-")), a.connections, a.rounds, a.beside_nettap)
    finally:
        switch.close()
    print(f"one step of a timer program's no (ns per run on timer:timer_start; {a.connections:,} connections "
          f"closed client first a round; kernel {os.uname().release}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')})")
    print(f"{'step':44s} {'runs':>7s} " + " ".join(f"{'round ' + str(i + 1):>8s}" for i in range(len(rounds)))
          + f" {'over empty':>11s}")
    labels = {**STEPS, **{f"nettap {n}": f"nettap's {n} (the closing case's no)" for n in BESIDE}}
    for name, label in ((n, labels[n]) for n in rounds[0]):
        over = sum(r[name][1] - r["step_empty"][1] for r in rounds) / len(rounds)
        print(f"{label:44s} {rounds[0][name][0]:7d} " + " ".join(f"{r[name][1]:8.0f}" for r in rounds)
              + f" {over:+11.0f}")


if __name__ == "__main__":
    main()
