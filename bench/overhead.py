#!/usr/bin/env python3
"""nettap's overhead on a real HTTP server, by the method of
shared/seeds/001 (A/B, alternated): nginx (its own minimal config in a temp
dir, a free loopback port, a small static file) under a constant request
rate (bench/loadgen.c, wrk2-style: each latency counted from the request's
scheduled send time, so a stall is not hidden by coordinated omission).

Cases, alternated A B C D, A B C D, ... (--reps times):
  A  no nettap
  B  nettap running, its capture filtered out (it captures a port nothing uses)
  C  nettap capturing nginx's port, output jsonl (a file in a temp dir)
  D  C with diagnostics.bpfStats.enabled: true
  E  C with `nettap ingest` beside it, publishing the file to a nats-server
     (JetStream, one node) on loopback: the capture's CPU and peak RSS against C
  S  D with capture.sample_connections: 10 (1 in 10 connections captured:
     with --close, a new connection each request, the rate it was made for);
     bpfStats on as in D, so its kernel time is printed beside D's

Printed per run and per case (the median of its runs): requests/s, latency
p50 and p99, nginx CPU (utime+stime of its master and workers, % of one
core: this includes the probes' kernel time on nginx's own syscalls),
nettap CPU (% of one core), records nettap drained and lost, and in D the
kernel's BPF run time a second (nettap_bpf_program_run_time_seconds_total),
and a request's share of it by program (and in S), with nettap's user CPU and
that kernel time together, the figure the overhead document's goals count.
The A/A spread (max - min over the A runs) is the noise floor the deltas
are printed against. Writes a plot of the latency distributions per case
to bench/out/overhead.png (matplotlib: `pip install -e .[bench]`).

Run as root:  .venv/bin/python bench/overhead.py [--rate 1000] [--seconds 10]
              [--reps 3] [--connections 10] [--workers 1]
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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _nettap import (OUT, build, cpu_s, family_sum, free_port, label_values, metrics,  # noqa: E402
                     start_ingest, start_nettap, status_mb, stop)

CASES = {
    "A": "no nettap",
    "B": "nettap, capture filtered out",
    "C": "nettap capturing nginx, jsonl",
    "D": "C + bpfStats enabled",
    "E": "C + nettap ingest beside it",
    "S": "D with sample_connections: 10",
}
PAGE = (b"<!DOCTYPE html>\n<html><head><title>nettap bench</title></head><body>\n"
        + b"<p>" + b"x" * 480 + b"</p>\n</body></html>\n")

NGINX_CONF = """\
worker_processes {workers};
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ text/html html; }}
    sendfile on;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    server {{
        listen 127.0.0.1:{port};
        root {tmp}/www;
        location / {{ }}
    }}
}}
"""


def start_nginx(tmp: str, port: int, workers: int) -> subprocess.Popen:
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(exe):
        raise SystemExit("nginx is not installed (Debian: apt-get install nginx)")
    os.makedirs(os.path.join(tmp, "www"))
    with open(os.path.join(tmp, "www", "index.html"), "wb") as f:
        f.write(PAGE)
    os.chmod(tmp, 0o755)                      # nginx's workers drop root
    with open(os.path.join(tmp, "nginx.conf"), "w") as f:
        f.write(NGINX_CONF.format(tmp=tmp, port=port, workers=workers))
    p = subprocess.Popen([exe, "-p", tmp, "-c", os.path.join(tmp, "nginx.conf"), "-e", os.path.join(tmp, "error.log")])
    import socket
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit(f"nginx did not answer; see {tmp}/error.log")


def write_config(tmp: str, case: str, nginx_port: int, unused_port: int, nats_url: str = "") -> str:
    port = unused_port if case == "B" else nginx_port
    text = (f"captures: [{{port: {port}}}]\n"
            f"output: {{type: jsonl, path: {tmp}/capture-{case}.jsonl, root: {tmp}, max_bytes: {1 << 30}}}\n")
    if case in "DS":
        text += "diagnostics: {bpfStats: {enabled: true}}\n"
    if case == "S":
        text += "capture: {sample_connections: 10}\n"
    if case == "E":
        text += f"ingest: {{servers: [{nats_url}], node: bench, stream: {{name: OVERHEAD}}}}\n"
    cfg = os.path.join(tmp, f"{case}.yaml")
    with open(cfg, "w") as f:
        f.write(text)
    return cfg


def run(a, case: str, loadgen: str, nginx: subprocess.Popen, tmp: str, nport: int, unused: int,
        nats_url: str = "") -> dict:
    p = ing = None
    if case != "A":
        mport = free_port()
        cfg = write_config(tmp, case, nport, unused, nats_url)
        p = start_nettap(cfg, mport)
        if case == "E":
            iport = free_port()
            ing = start_ingest(cfg, iport)
        time.sleep(a.settle)
        i0 = cpu_s(ing.pid) if ing else 0
        m0 = metrics(mport)
        c0 = cpu_s(p.pid)
    out = os.path.join(tmp, "latencies.f64")
    try:
        g0, w0 = cpu_s(nginx.pid), time.perf_counter()
        r = subprocess.run([loadgen, "127.0.0.1", str(nport), "/index.html", str(a.rate), str(a.seconds),
                            str(a.connections), str(a.warmup), out] + (["close"] if a.close else []),
                           capture_output=True, text=True)
        wall = time.perf_counter() - w0
        ngx = (cpu_s(nginx.pid) - g0) / wall
        if p is not None:
            c1 = cpu_s(p.pid)
            m1 = metrics(mport)
            hwm = status_mb(p.pid, "VmHWM")
        if ing is not None:
            i1 = cpu_s(ing.pid)
            acked = metrics(iport).get("nettap_ingest_records_acked_total", 0)
    finally:
        if ing is not None:
            stop(ing)
        if p is not None:
            stop(p)
    if r.returncode:
        raise SystemExit(f"loadgen failed: {r.stdout} {r.stderr}")
    f = r.stdout.split()
    res = dict(case=case, rps=float(f[f.index("rate") + 1]), errors=int(f[f.index("errors") + 1]),
               late_max_us=float(f[f.index("late_max_us") + 1]), nginx=ngx, wall=wall,
               lat=np.fromfile(out, dtype=np.float64))
    res["p50"], res["p99"] = np.percentile(res["lat"], [50, 99]) / 1000      # ms
    if ing is not None:
        res["ingest"] = (i1 - i0) / wall
        res["acked"] = acked
    if p is not None:
        res["nettap"] = (c1 - c0) / wall
        res["hwm"] = hwm
        res["drained"] = family_sum(m1, "nettap_ringbuf_records_drained_total") - \
            family_sum(m0, "nettap_ringbuf_records_drained_total")
        res["lost"] = sum(family_sum(m1, k) - family_sum(m0, k)
                          for k in ("nettap_ringbuf_drops_total", "nettap_records_lost_total"))
        if case in "DS":
            rt1 = label_values(m1, "nettap_bpf_program_run_time_seconds_total")
            rt0 = label_values(m0, "nettap_bpf_program_run_time_seconds_total")
            runs = family_sum(m1, "nettap_bpf_program_runs_total") - family_sum(m0, "nettap_bpf_program_runs_total")
            res["bpf_progs"] = {k: v - rt0.get(k, 0) for k, v in rt1.items()}     # s of kernel time each
            bpf = sum(res["bpf_progs"].values())
            res["bpf"] = bpf / wall
            res["bpf_ns_run"] = bpf / runs * 1e9 if runs else float("nan")
            res["bpf_runs"] = runs / wall
            res["bpf_stats_on"] = family_sum(m1, "nettap_bpf_stats_enabled")
    return res


def fmt(res: dict) -> str:
    s = (f"{res['rps']:>9,.1f}{res['p50']:>9.3f}{res['p99']:>9.3f}{res['nginx'] * 100:>10.2f}")
    s += f"{res['nettap'] * 100:>10.2f}" if "nettap" in res else f"{'-':>10}"
    s += (f"{res['drained'] / res['wall']:>11,.0f}{res['drained'] / res['wall'] / res['rps']:>9.2f}"
          f"{int(res['lost']):>7,}" if "drained" in res else f"{'-':>11}{'-':>9}{'-':>7}")
    s += f"{res['bpf'] * 1e3:>10.3f}" if "bpf" in res else f"{'-':>10}"
    return s + f"{res['errors']:>5}"


HEAD = (f"{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'nginx %':>10}{'nettap %':>10}{'records/s':>11}{'rec/req':>9}"
        f"{'lost':>7}"
        f"{'BPF ms/s':>10}{'err':>5}")


def plot(results: list, path: str, a) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(no plot: matplotlib is not installed; pip install -e .[bench])")
        return
    colors = {"A": "tab:gray", "B": "tab:blue", "C": "tab:orange", "D": "tab:red", "E": "tab:green", "S": "tab:purple"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    q = np.array([0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99])
    x = -np.log10(1 - q / 100.0001)
    seen = set()
    for r in results:
        lat = np.sort(r["lat"]) / 1000
        pcts = np.linspace(0, 99.99, 400)
        ax1.plot(-np.log10(1 - pcts / 100.0001), np.percentile(lat, pcts), color=colors[r["case"]], lw=1.1,
                 alpha=0.8, label=None if r["case"] in seen else f"{r['case']}: {CASES[r['case']]}")
        seen.add(r["case"])
    ax1.set_xticks(x)
    ax1.set_xticklabels([f"{v:g}" for v in q], fontsize=8)
    ax1.set_yscale("log")
    ax1.set_xlabel("percentile")
    ax1.set_ylabel("latency from scheduled send (ms)")
    ax1.set_title("latency by percentile, one line per run")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    pooled = [np.concatenate([r["lat"] for r in results if r["case"] == c]) / 1000 for c in a.cases]
    parts = ax2.violinplot([np.log10(p) for p in pooled], showmedians=True)
    for body, c in zip(parts["bodies"], a.cases):
        body.set_facecolor(colors[c])
        body.set_alpha(0.6)
    ax2.set_xticks(range(1, len(a.cases) + 1))
    ax2.set_xticklabels(list(a.cases))
    ticks = np.arange(-2, 3)
    ax2.set_yticks(ticks)
    ax2.set_yticklabels([f"{10.0 ** t:g}" for t in ticks])
    ax2.set_ylabel("latency (ms, log scale)")
    ax2.set_title("distribution per case, runs pooled")
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"nginx at {a.rate:g} requests/s, {a.connections} keep-alive connections, "
                 f"{a.seconds:g} s per run x {a.reps} runs per case ({os.cpu_count()} CPUs, "
                 f"kernel {os.uname().release})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot of the latency distributions per case: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000, help="requests a second (1000)")
    ap.add_argument("--seconds", type=float, default=10, help="recorded seconds of each run (10)")
    ap.add_argument("--warmup", type=float, default=1, help="seconds sent but not recorded first (1)")
    ap.add_argument("--reps", type=int, default=3, help="times each case runs, alternated (3)")
    ap.add_argument("--connections", type=int, default=10, help="keep-alive connections (10)")
    ap.add_argument("--close", action="store_true",
                    help="a new connection each request (Connection: close; --connections at once)")
    ap.add_argument("--cases", default="".join(CASES), help="the cases run, e.g. ACS (all)")
    ap.add_argument("--workers", type=int, default=1, help="nginx worker processes (1)")
    ap.add_argument("--settle", type=float, default=1, help="seconds between nettap ready and the load (1)")
    ap.add_argument("--plot", default=os.path.join(OUT, "overhead.png"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    if "A" not in a.cases or set(a.cases) - set(CASES):
        raise SystemExit(f"--cases: some of {''.join(CASES)}, A among them (the baseline)")
    a.cases = [c for c in CASES if c in a.cases]

    loadgen = build("loadgen")
    tmp = tempfile.mkdtemp(prefix="nettap-overhead-")
    nport, unused = free_port(), free_port()
    nginx = start_nginx(tmp, nport, a.workers)
    nats_port = free_port()
    nats = subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", f"{tmp}/nats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    print(f"nginx {nport} (pid {nginx.pid}), {a.rate:g} requests/s, "
          + (f"a new connection each ({a.connections} at once), " if a.close
             else f"{a.connections} keep-alive connections, ")
          + f"{a.warmup:g} + {a.seconds:g} s a run, cases {' '.join(a.cases)} alternated x {a.reps}\n")
    print(f"{'run':<7}{HEAD}")
    try:
        for rep in range(a.reps):
            for case in a.cases:
                r = run(a, case, loadgen, nginx, tmp, nport, unused, f"nats://127.0.0.1:{nats_port}")
                results.append(r)
                print(f"{case}{rep + 1:<6}{fmt(r)}", flush=True)
                for f in os.listdir(tmp):
                    if f.startswith("capture-"):
                        os.unlink(os.path.join(tmp, f))
    finally:
        nats.terminate()
        nats.wait(30)
        nginx.terminate()
        nginx.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, a)
    plot(results, a.plot, a)


def report(results: list, a) -> None:
    def med(case, key):
        v = [r[key] for r in results if r["case"] == case and key in r]
        return statistics.median(v) if v else None

    print(f"\nmedian of {a.reps} runs per case   (A/A spread = max - min over the A runs: the noise floor)")
    print(f"{'case':<7}{HEAD}")
    for case in a.cases:
        rs = [r for r in results if r["case"] == case]
        m = {k: med(case, k) for k in rs[0] if k not in ("case", "lat", "bpf_progs")}
        m["errors"] = sum(r["errors"] for r in rs)
        print(f"{case:<7}{fmt(m)}   {CASES[case]}")
    aa = {k: max(r[k] for r in results if r["case"] == "A") - min(r[k] for r in results if r["case"] == "A")
          for k in ("rps", "p50", "p99", "nginx")}
    print(f"{'A/A':<7}{aa['rps']:>9,.1f}{aa['p50']:>9.3f}{aa['p99']:>9.3f}{aa['nginx'] * 100:>10.2f}"
          f"   spread between the A runs")
    print("\ndeltas against A (medians), beside the A/A spread:")
    base = {k: med("A", k) for k in ("p50", "p99", "nginx")}
    for case in a.cases[1:]:
        d50, d99 = med(case, "p50") - base["p50"], med(case, "p99") - base["p99"]
        dng = (med(case, "nginx") - base["nginx"]) * 100
        within = "within" if abs(d99) <= aa["p99"] else "OUTSIDE"
        print(f"  {case}: p50 {d50 * 1000:+.0f} us (A/A {aa['p50'] * 1000:.0f} us), "
              f"p99 {d99 * 1000:+.0f} us (A/A {aa['p99'] * 1000:.0f} us: {within} the noise), "
              f"nginx CPU {dng:+.2f} points (A/A {aa['nginx'] * 100:.2f}), "
              f"nettap {med(case, 'nettap') * 100:.2f} % of a core")
    c, e = ([r for r in results if r["case"] == k] for k in "CE")
    if c and e:
        print(f"  E against C, the capture beside nettap ingest: CPU {med('C', 'nettap') * 100:.2f} -> "
              f"{med('E', 'nettap') * 100:.2f} % of a core, peak RSS {med('C', 'hwm'):.1f} -> {med('E', 'hwm'):.1f} MB "
              f"(C/C spread {max(r['nettap'] for r in c) * 100 - min(r['nettap'] for r in c) * 100:.2f} points, "
              f"{max(r['hwm'] for r in c) - min(r['hwm'] for r in c):.1f} MB); ingest {med('E', 'ingest') * 100:.2f} "
              f"% of a core, {statistics.median(r['acked'] for r in e):,.0f} lines acknowledged a run")
    for k in "DS":
        kernel_time(k, [r for r in results if r["case"] == k])


def kernel_time(case: str, d: list) -> None:
    """Case D's or S's kernel BPF time: a second, a run, a request, by program; with nettap's own CPU."""
    if not d:
        return
    bpf = statistics.median(r["bpf"] for r in d)
    rps = statistics.median(r["rps"] for r in d)
    own = statistics.median(r["nettap"] + r["bpf"] for r in d)
    print(f"  {case}: kernel BPF time {bpf * 1e3:.3f} ms a second = {bpf * 100:.3f} % of a core "
          f"({statistics.median(r['bpf_runs'] for r in d):,.0f} program runs/s, "
          f"{statistics.median(r['bpf_ns_run'] for r in d):.0f} ns a run, "
          f"{bpf / rps * 1e9:,.0f} ns a request; bpfStats on: "
          f"{'yes' if all(r['bpf_stats_on'] for r in d) else 'NO'}); "
          f"nettap user + kernel BPF {own * 100:.2f} % of a core")
    # a request's kernel time by program: each run's seconds over its requests, the median of the case's runs
    per = {p: statistics.median(r["bpf_progs"].get(p, 0) / (r["rps"] * r["wall"]) * 1e9 for r in d)
           for p in {p for r in d for p in r["bpf_progs"]}}
    print("     by program, ns a request: " + ", ".join(f"{p} {ns:,.0f}" for p, ns in
                                                      sorted(per.items(), key=lambda kv: -kv[1]) if ns >= 1))

if __name__ == "__main__":
    main()
