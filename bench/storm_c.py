#!/usr/bin/env python3
"""The TCP prober's storm (shared/seeds/002): short loopback connections
from a C program (bench/storm.c: connect, send 64 bytes, the server echoes
64 bytes, close), 20,000 connections x 3 rounds, 4 threads, with nettap
capturing the storm's port through a 16 MiB chunk ring, once with
`output: jsonl` (a file in a temp dir) and once with `output: none`.

Printed per round and per ring (capture_chunks, capture_eof, logs):
  published  chunks: nettap_probe_chunks_published_total (all probes);
             eof and logs: the lines of that type the jsonl sink wrote
             (with output none, no such count exists: drained + dropped)
  drained    nettap_ringbuf_records_drained_total
  dropped    nettap_ringbuf_drops_total (the kernel's reserve failed)
and user-space losses (nettap_records_lost_total by stage), nettap's CPU-s
per million records drained (utime+stime from before the round to the end
of its drain: the whole process, and its drain and sink threads apart), its
peak RSS (VmHWM) beside its idle RSS, and connections/s beside the same storm without nettap, measured in
the same run before and after the captured rounds.

With jsonl, the JSON lines' rate (bytes/s the sink wrote over the round,
and what it would have written had nothing been lost) is printed beside
what one writer of the same blocks reaches in the same run, alone (2 MiB
os.write calls appending to a new file in the same directory), over a
file's first 512 MB and over the 1.5 GB after them: the page cache's limit
here, which nettap's sink, formatting too and sharing the CPUs with the
storm, cannot pass.

Run as root:  .venv/bin/python bench/storm_c.py [--connections 20000]
              [--rounds 3] [--threads 4] [--bytes 64] [--chunk-ring 16777216]
              [--queue-bytes 4194304] [--sinks jsonl,none] [--sync]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _nettap import (RINGS, build, cpu_s, family_sum, free_port, label_values, metrics,  # noqa: E402
                     start_nettap, status_mb, stop, thread_cpu_s)

PIPELINE_THREADS = ("nettap-drain", "nettap-sink")     # what records cost, apart from scrapes and timers

TYPES = {"capture_chunks": b'"type":"chunk"', "capture_eof": b'"type":"eof"', "logs": b'"type":"log"'}


def run_storm(exe: str, port: int, a) -> float:
    """Connections a second of one round."""
    out = subprocess.run([exe, str(port), str(a.connections), str(a.threads), str(a.bytes)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"storm failed ({out.returncode}): {out.stdout.strip()} {out.stderr.strip()}")
    f = out.stdout.split()
    return float(f[f.index("rate") + 1])


def settle(mport: int, sink: str, timeout: float = 120.0) -> tuple:
    """Wait until nettap has drained its rings and its sink has written (or
    counted lost) every drained record; returns (metrics, seconds waited)."""
    t0 = time.perf_counter()
    prev = None
    while True:
        m = metrics(mport)
        pending = family_sum(m, "nettap_ringbuf_pending_bytes")
        drained = family_sum(m, "nettap_ringbuf_records_drained_total")
        done = family_sum(m, "nettap_sink_records_written_total") + family_sum(m, "nettap_records_lost_total")
        if pending == 0 and drained == prev and (sink == "none" or done >= drained):
            return m, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            print(f"  (not settled after {timeout:.0f} s: pending {pending:.0f} B, drained {drained:.0f}, "
                  f"written+lost {done:.0f})")
            return m, time.perf_counter() - t0
        prev = drained
        time.sleep(0.25)


def delta(m1: dict, m0: dict, name: str) -> dict:
    a, b = label_values(m1, name), label_values(m0, name)
    return {k: int(v - b.get(k, 0)) for k, v in a.items()}


WRITE_BLOCK = 2 << 20          # the sink's batches: half the default 4 MiB queue at most


def dirty_mb() -> tuple:
    """(Dirty, Writeback) of /proc/meminfo in MB: what the page cache still has to write out."""
    got = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("Dirty", "Writeback"):
                got[k] = int(v.split()[0]) / 1024
    return got.get("Dirty", 0.0), got.get("Writeback", 0.0)


def page_cache_rates(tmp: str, first: int = 512 << 20, rest: int = 1536 << 20) -> tuple:
    """(bytes/s, bytes/s): one writer of WRITE_BLOCK-byte blocks of JSON-like
    text appending to a new file in tmp, nothing else running: over the
    file's first `first` bytes, then over the `rest` after them (here the
    page cache takes a file's first few hundred MB faster than the rest)."""
    block = (b'{"data":"' + b"A" * 5400 + b'","type":"chunk"}\n') * (WRITE_BLOCK // 5427)
    path = os.path.join(tmp, "page-cache.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    rates = []
    try:
        for size in (first, rest):
            n, t0 = 0, time.perf_counter()
            while n < size:
                n += os.write(fd, block)
            rates.append(n / (time.perf_counter() - t0))
    finally:
        os.close(fd)
        os.unlink(path)
    return tuple(rates)


def count_lines(path: str, offset: int) -> tuple:
    """({ring: lines of its type} written after offset, new offset)."""
    counts = {r: 0 for r in RINGS}
    if not os.path.exists(path):
        return counts, offset
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            block = f.read(64 << 20)
            if not block:
                break
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                break
            f.seek(cut - len(block), 1)
            block = block[:cut]
            offset += cut
            for r, t in TYPES.items():
                counts[r] += block.count(t)
    return counts, offset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=20000, help="connections a round (20000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="client threads (and server threads)")
    ap.add_argument("--bytes", type=int, default=64, help="bytes sent and echoed on each connection (64)")
    ap.add_argument("--chunk-ring", type=int, default=16 << 20, help="capture_chunks ring bytes (16 MiB)")
    ap.add_argument("--queue-bytes", type=int, default=4 << 20, help="output.queue_bytes (4 MiB, the default)")
    ap.add_argument("--sinks", default="jsonl,none", help="comma-separated outputs to run: jsonl,none")
    ap.add_argument("--sync", action="store_true",
                    help="sync(2) before each round: it starts with no dirty page left to write back")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")

    exe = build("storm")
    port, mport = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="nettap-storm-")
    base = []
    results = {}
    try:
        base += [run_storm(exe, port, a) for _ in range(a.rounds)]
        cache = page_cache_rates(tmp) if "jsonl" in a.sinks.split(",") else None
        for sink in a.sinks.split(","):
            results[sink] = captured(a, exe, sink, port, mport, tmp)
        base += [run_storm(exe, port, a) for _ in range(a.rounds)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(a, base, results, cache)


def captured(a, exe: str, sink: str, port: int, mport: int, tmp: str) -> dict:
    path = os.path.join(tmp, "capture.jsonl")
    out = (f"{{type: jsonl, path: {path}, root: {tmp}, max_bytes: {1 << 40}, queue_bytes: {a.queue_bytes}}}"
           if sink == "jsonl" else "{type: none}")
    cfg = os.path.join(tmp, f"{sink}.yaml")
    with open(cfg, "w") as f:
        f.write(f"captures: [{{port: {port}}}]\noutput: {out}\nrings: {{capture_chunks: {a.chunk_ring}}}\n")
    p = start_nettap(cfg, mport)
    rounds = []
    try:
        time.sleep(1)
        c0, t0 = cpu_s(p.pid), time.perf_counter()
        time.sleep(2)
        idle_cpu = (cpu_s(p.pid) - c0) / (time.perf_counter() - t0)
        idle_rss = status_mb(p.pid, "VmRSS")
        offset = 0
        m0, _ = settle(mport, sink)
        for _ in range(a.rounds):
            if a.sync:
                os.sync()                # each round starts with nothing left to write back
            dirty = dirty_mb()
            c0, th0 = cpu_s(p.pid), thread_cpu_s(p.pid)
            rate = run_storm(exe, port, a)
            m1, tail = settle(mport, sink)
            cpu, th1 = cpu_s(p.pid) - c0, thread_cpu_s(p.pid)
            pipe = sum(th1.get(t, 0) - th0.get(t, 0) for t in PIPELINE_THREADS)
            lines, offset = count_lines(path, offset) if sink == "jsonl" else (None, offset)
            drained = delta(m1, m0, "nettap_ringbuf_records_drained_total")
            dropped = delta(m1, m0, "nettap_ringbuf_drops_total")
            chunks = sum(delta(m1, m0, "nettap_probe_chunks_published_total").values())
            if lines is not None:
                published = dict(lines, capture_chunks=chunks)
            else:
                published = {r: drained.get(r, 0) + dropped.get(r, 0) for r in RINGS}
                published["capture_chunks"] = chunks
            wrote = delta(m1, m0, "nettap_sink_bytes_written_total").get("jsonl", 0)
            written = delta(m1, m0, "nettap_sink_records_written_total").get("jsonl", 0)
            rounds.append(dict(rate=rate, tail=tail, cpu=cpu, pipe=pipe, drained=drained, dropped=dropped,
                               published=published, lines=lines, wrote=wrote, written=written, dirty=dirty,
                               lost=delta(m1, m0, "nettap_records_lost_total")))
            m0 = m1
        hwm = status_mb(p.pid, "VmHWM")
    finally:
        stop(p)
    return dict(rounds=rounds, idle_cpu=idle_cpu, idle_rss=idle_rss, hwm=hwm)


def report(a, base: list, results: dict, cache) -> None:
    b = statistics.mean(base)
    print(f"\nnettap under the prober's storm: {a.connections:,} loopback connections x {a.rounds} rounds, "
          f"{a.threads} threads, {a.bytes}-byte echo; capture_chunks ring {a.chunk_ring / (1 << 20):g} MiB, "
          f"other rings default; {os.cpu_count()} CPUs, kernel {os.uname().release}\n")
    print(f"baseline, the storm without nettap: {b:,.0f} connections/s (mean of {len(base)} rounds: "
          f"{a.rounds} before and {a.rounds} after the captured ones; min {min(base):,.0f}, max {max(base):,.0f})")
    if cache:
        print(f"page cache here, one writer of {WRITE_BLOCK >> 20} MiB blocks appending to a new file, nothing "
              f"else running: {cache[0] / 1e6:,.0f} MB/s over its first 512 MB, {cache[1] / 1e6:,.0f} MB/s "
              f"over the next 1.5 GB")
    summary = []
    for sink, r in results.items():
        print(f"\noutput: {sink}   (nettap idle: {r['idle_cpu'] * 100:.2f} % of a core, RSS {r['idle_rss']:.1f} MB)")
        for i, x in enumerate(r["rounds"], 1):
            recs = sum(x["drained"].values())
            per_m = x["cpu"] / recs * 1e6 if recs else float("nan")
            pipe_m = x["pipe"] / recs * 1e6 if recs else float("nan")
            print(f"  round {i}: {x['rate']:,.0f} connections/s ({x['rate'] / b:.2f}x baseline), "
                  f"drained {x['tail']:.1f} s after the storm; nettap CPU {x['cpu']:.2f} s = "
                  f"{per_m:.2f} CPU-s per million records ({recs:,} records; drain and sink threads: "
                  f"{pipe_m:.2f})")
            print(f"    {'ring':<16}{'published':>12}{'drained':>12}{'dropped':>10}")
            for ring in RINGS:
                note = ""
                if ring != "capture_chunks":
                    note = "   (published: its lines in the jsonl file)" if x["lines"] is not None \
                        else "   (published: drained + dropped, no other count)"
                print(f"    {ring:<16}{x['published'].get(ring, 0):>12,}{x['drained'].get(ring, 0):>12,}"
                      f"{x['dropped'].get(ring, 0):>10,}{note}")
            lost = ", ".join(f"{k} {v:,}" for k, v in sorted(x["lost"].items()))
            print(f"    user-space lost: {lost or 'none reported'}")
            if x["written"]:
                storm_s = a.connections / x["rate"]
                whole = x["wrote"] / x["written"] * recs          # every drained record's lines
                span = storm_s + x["tail"]
                print(f"    page cache at the round's start: {x['dirty'][0]:,.0f} MB dirty, "
                      f"{x['dirty'][1]:,.0f} MB under writeback")
                print(f"    JSON lines: wrote {x['wrote'] / 1e6:,.0f} MB, {x['wrote'] / span / 1e6:,.0f} "
                      f"MB/s over the storm and its drain ({span:.1f} s); every record's lines: "
                      f"{whole / 1e6:,.0f} MB, {whole / storm_s / 1e6:,.0f} MB/s over the storm ({storm_s:.1f} s)")
        rs = r["rounds"]
        recs = sum(sum(x["drained"].values()) for x in rs)
        cpu = sum(x["cpu"] for x in rs)
        drops = sum(sum(x["dropped"].values()) for x in rs)
        ulost = sum(sum(x["lost"].values()) for x in rs)
        rate = statistics.mean(x["rate"] for x in rs)
        pipe = sum(x["pipe"] for x in rs)
        summary.append((sink, rate, recs, drops, ulost, cpu / recs * 1e6 if recs else float("nan"),
                        pipe / recs * 1e6 if recs else float("nan"), r["hwm"], r["idle_rss"]))
        print(f"  peak RSS (VmHWM) {r['hwm']:.1f} MB (idle RSS before the storm: {r['idle_rss']:.1f} MB)")

    print(f"\n{'':<10}{'conn/s':>10}{'x base':>8}{'records':>11}{'ring drops':>12}{'user lost':>11}"
          f"{'CPU-s/M rec':>13}{'pipeline':>10}{'peak RSS MB':>13}")
    print(f"{'baseline':<10}{b:>10,.0f}{1:>8.2f}")
    for sink, rate, recs, drops, ulost, per_m, pipe_m, hwm, _ in summary:
        print(f"{sink:<10}{rate:>10,.0f}{rate / b:>8.2f}{recs:>11,}{drops:>12,}{ulost:>11,}{per_m:>13.2f}"
              f"{pipe_m:>10.2f}{hwm:>13.1f}")
    print("\n(CPU-s/M rec: nettap's whole process from the storm's start to the end of its drain, the "
          "benchmark's own scrapes and nettap's timers included; pipeline: its drain and sink threads only)")


if __name__ == "__main__":
    main()
