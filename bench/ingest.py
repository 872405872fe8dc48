#!/usr/bin/env python3
"""nettap ingest beside the capture under the prober's storm (bench/storm.c:
short loopback connections, 64-byte echo), publishing to nats-server
JetStream on loopback: one node by default (an R1 file stream), or a
three-node cluster (--engine-nodes 3: an R3 stream, every line stored three
times on this machine).

Three passes in one run: A, the capture alone; B, the same storm with ingest
running beside it; C, ingest alone forwarding B's files again from their
start to a stream of their own (its pace when it has the CPUs, as after a
storm or an outage). Printed:
  - lines/s the capture wrote during the storm beside lines/s ingest had
    acknowledged by the engine, and how long after the storm the backlog took
    to drain (the post-load drain); C's lines/s beside the capture's;
  - lines lost and stored twice: the stream read back against the files;
  - ingest's peak RSS (VmHWM) and CPU-s;
  - the capture's CPU-s and peak RSS in A and in B (ingest must not change them).

The engine stands in for one on other machines, as in a fleet: its nodes run
at nice 19 by default (--engine-nice 0: its CPU competes with the capture's
here; its disk writes do either way). Ingest runs at its default nice 10
(--ingest-nice 0: it competes like the capture, as a container with its own
CPU request does).

Run as root:  .venv/bin/python bench/ingest.py [--connections 20000] [--rounds 3] [--threads 4]
              [--engine-nodes 1] [--engine-nice 19] [--ingest-nice 10] [--batch-bytes 262144]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))     # the test suite's nats-server cluster
from _nettap import build, cpu_s, free_port, metrics, start_ingest, start_nettap, status_mb, stop  # noqa: E402
from natscluster import NatsCluster  # noqa: E402
from storm_c import run_storm  # noqa: E402


def written(mport: int) -> float:
    return metrics(mport).get('nettap_sink_records_written_total{sink="jsonl"}', 0.0)


def one_pass(a, exe, port, tmp: Path, cluster, with_ingest: bool) -> dict:
    urls = cluster.urls
    d = tmp / ("b" if with_ingest else "a")
    d.mkdir()
    path = d / "capture.jsonl"
    cfg = d / "nettap.yaml"
    cfg.write_text(f"captures: [{{port: {port}}}]\n"
                   f"output: {{type: jsonl, path: {path}, root: {d}, max_bytes: {64 << 20}, backups: 20}}\n"
                   f"ingest: {{servers: {list(urls)}, node: bench, batch_bytes: {a.batch_bytes}, "
                   f"stream: {{name: BENCH, replicas: {a.engine_nodes}, duplicate_window: 10m, "
                   f"storage: {a.engine_storage}}}}}\n")
    cport, iport = free_port(), free_port()
    cap = start_nettap(str(cfg), cport)
    ing = start_ingest(str(cfg), iport, ["--nice", str(a.ingest_nice)]) if with_ingest else None
    r = {}
    try:
        time.sleep(1)
        c0, i0 = cpu_s(cap.pid), cpu_s(ing.pid) if ing else 0
        engine = [n.proc.pid for n in cluster.nodes if n.proc is not None]
        e0 = sum(cpu_s(pid) for pid in engine)
        w0 = written(cport)
        t0 = time.perf_counter()
        rates = [run_storm(exe, port, a) for _ in range(a.rounds)]
        t_storm = time.perf_counter() - t0
        while True:                                     # the capture's own drain
            w1 = written(cport)
            time.sleep(0.5)
            if written(cport) == w1:
                break
        r["lines"] = w1 - w0
        r["write_rate"] = r["lines"] / t_storm
        r["storm_rate"] = sum(rates) / len(rates)
        if ing:
            deadline = time.time() + 600
            while metrics(iport).get("nettap_ingest_backlog_bytes", 1) > 0 and time.time() < deadline:
                time.sleep(0.1)
            t_done = time.perf_counter() - t0
            m = metrics(iport)
            r["acked"] = m["nettap_ingest_records_acked_total"]
            r["forward_rate"] = r["acked"] / t_done
            r["drain_after"] = max(t_done - t_storm, 0.0)
            r["lost"] = sum(v for k, v in m.items() if k.startswith("nettap_ingest_records_lost_total"))
            r["cap_lost"] = sum(v for k, v in metrics(cport).items()
                                if k.startswith(("nettap_records_lost_total", "nettap_ringbuf_drops_total")))
            r["ingest_cpu"] = cpu_s(ing.pid) - i0
            r["engine_cpu"] = sum(cpu_s(pid) for pid in engine) - e0
            r["ingest_hwm"] = status_mb(ing.pid, "VmHWM")
        r["cap_cpu"] = cpu_s(cap.pid) - c0
        r["cap_hwm"] = status_mb(cap.pid, "VmHWM")
        stop(cap)                                       # its stop line, the files' last, forwarded too
        if ing:
            while metrics(iport).get("nettap_ingest_backlog_bytes", 1) > 0 and time.time() < deadline:
                time.sleep(0.1)
    finally:
        if ing:
            stop(ing)
        stop(cap)
    if with_ingest:
        r["files"] = sorted(p for p in d.iterdir() if p.name == "capture.jsonl" or p.suffix[1:].isdigit())
    return r


def catch_up(a, tmp: Path, cluster) -> dict:
    """Ingest's own pace: B's files forwarded again from their start, to a
    stream of their own, with the storm and the capture gone (ingest and the
    engine alone on these CPUs, as after a storm or an outage)."""
    d = tmp / "b"
    cfg = d / "catch-up.yaml"
    cfg.write_text(f"output: {{type: jsonl, path: {d / 'capture.jsonl'}, root: {d}, max_bytes: {64 << 20}, "
                   f"backups: 20}}\n"
                   f"ingest: {{servers: {list(cluster.urls)}, node: bench, batch_bytes: {a.batch_bytes}, "
                   f"subject: 'catchup.{{node}}.{{kind}}', checkpoint: {d / 'catch-up.checkpoint'}, "
                   f"stream: {{name: CATCHUP, replicas: {a.engine_nodes}, duplicate_window: 10m, "
                   f"storage: {a.engine_storage}}}}}\n")
    iport = free_port()
    ing = start_ingest(str(cfg), iport, ["--nice", str(a.ingest_nice)])
    try:
        t0, n0, c0 = time.perf_counter(), metrics(iport)["nettap_ingest_records_acked_total"], cpu_s(ing.pid)
        while metrics(iport).get("nettap_ingest_backlog_bytes", 1) > 0:
            time.sleep(0.02)
        t = time.perf_counter() - t0
        acked = metrics(iport)["nettap_ingest_records_acked_total"]
        return {"lines": acked, "rate": (acked - n0) / t, "cpu": cpu_s(ing.pid) - c0}
    finally:
        stop(ing)


def compare(urls, files) -> tuple:
    """(lines missing from the stream, lines stored twice)."""
    import nats
    from exporter.ingest import source

    async def go():
        nc = await nats.connect(list(urls))
        try:
            return await source.fetch(nc, "BENCH")
        finally:
            await nc.close()
    got = Counter(line for lines in source.lines(asyncio.run(go())).values() for line in lines)
    want = Counter(line for f in files for line in f.read_bytes().splitlines(True))
    return sum((want - got).values()), sum((got - want).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=64)
    ap.add_argument("--ingest-nice", type=int, default=10,
                    help="nettap ingest --nice (10, its default: it yields to the capture and the storm "
                         "when they share CPUs; 0: it competes like them, as a container with its own CPU "
                         "request does)")
    ap.add_argument("--engine-nodes", type=int, default=1, choices=(1, 3),
                    help="nats-server nodes, and the stream's replicas (3: a cluster, every line stored three "
                         "times on this machine; 1: one node)")
    ap.add_argument("--engine-nice", type=int, default=19,
                    help="the engine nodes' niceness (19: in a fleet the engine runs on other machines; "
                         "0: it competes for these CPUs as much as the capture)")
    ap.add_argument("--engine-storage", choices=("file", "memory"), default="file",
                    help="the stream's storage (file; memory needs each node's memory store to hold every "
                         "line three times over)")
    ap.add_argument("--engine-dir", help="where the engine's nodes keep their stores (e.g. /dev/shm: a tmpfs, "
                                          "off the disk the capture writes to; default: beside the capture's files)")
    ap.add_argument("--batch-bytes", type=int, default=262144, help="ingest.batch_bytes (262144, the default)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the capture loads BPF programs")
    exe = build("storm")
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="nettap-ingest-bench-"))
    engine_dir = Path(tempfile.mkdtemp(prefix="nettap-ingest-bench-nats-", dir=a.engine_dir or tmp))
    try:
        with NatsCluster(engine_dir, n=a.engine_nodes) as c:
            if a.engine_nice:                           # standing in for an engine on other machines
                for n in c.nodes:
                    os.setpriority(os.PRIO_PROCESS, n.proc.pid, a.engine_nice)
            alone = one_pass(a, exe, port, tmp, c, False)
            beside = one_pass(a, exe, port, tmp, c, True)
            missing, twice = compare(c.urls, beside["files"])
            pace = catch_up(a, tmp, c)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(engine_dir, ignore_errors=True)
    print(f"\nnettap ingest under the prober's storm: {a.connections:,} connections x {a.rounds} rounds, "
          f"{a.threads} threads, {a.bytes}-byte echo; {a.engine_nodes}-node nats-server {c_version()} "
          f"R{a.engine_nodes} {a.engine_storage} stream on "
          f"loopback (nice {a.engine_nice}, stores in {a.engine_dir or 'the temp dir, beside the files'}); "
          f"{os.cpu_count()} CPUs, kernel {os.uname().release}\n")
    b = beside
    print(f"capture wrote     {b['lines']:>12,.0f} lines  {b['write_rate']:>10,.0f} lines/s over the storm")
    print(f"ingest forwarded  {b['acked']:>12,.0f} lines  {b['forward_rate']:>10,.0f} lines/s, storm start to "
          f"backlog 0 ({b['drain_after']:.1f} s after the storm)")
    print(f"lost: {b['lost']:.0f} counted by ingest; stream vs files: {missing} missing, {twice} stored twice; "
          f"the capture's own losses (ring drops, queue, sink) with ingest beside it: {b['cap_lost']:.0f}")
    print(f"ingest: peak RSS {b['ingest_hwm']:.1f} MB, CPU {b['ingest_cpu']:.2f} s "
          f"({b['ingest_cpu'] / b['acked'] * 1e6:.2f} CPU-s per million lines; batch_bytes {a.batch_bytes}); "
          f"the engine: CPU {b['engine_cpu']:.2f} s")
    print(f"ingest alone, the same files again: {pace['lines']:,.0f} lines at {pace['rate']:,.0f} lines/s "
          f"(CPU {pace['cpu']:.2f} s), against the {b['write_rate']:,.0f} the capture wrote")
    print(f"\n{'capture':<22}{'storm conn/s':>14}{'lines':>12}{'CPU-s':>8}{'peak RSS MB':>13}")
    for name, r in (("A alone", alone), ("B with ingest beside", beside)):
        print(f"{name:<22}{r['storm_rate']:>14,.0f}{r['lines']:>12,.0f}{r['cap_cpu']:>8.2f}{r['cap_hwm']:>13.1f}")
    print(f"capture CPU-s per million lines: A {alone['cap_cpu'] / alone['lines'] * 1e6:.2f}, "
          f"B {beside['cap_cpu'] / beside['lines'] * 1e6:.2f}")


def c_version() -> str:
    out = subprocess.run(["nats-server", "--version"], capture_output=True, text=True).stdout.strip()
    return out.split()[-1] if out else "?"


if __name__ == "__main__":
    main()
