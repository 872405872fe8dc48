#!/usr/bin/env python3
"""The seeds' tables reproduced here, each of nettap's figures printed beside
the document's (shared/seeds/000 and 001; their numbers are typed in below).

Section `ladder`, the resource document's usage table (000, "Observed
Resource Usage"): its workload, a Go HTTP application making outbound TLS
calls (tests/go/gotls mode api: every GET /call makes one HTTPS GET of 512
bytes from a local https-server over a keep-alive transport), captured by
a pid target with capture.tls on (Go's crypto/tls plaintext) and bpfStats
on; `nettap ingest` beside it publishes the capture's file to a one-node
nats-server (JetStream, nice 19). One nettap and one ingest serve the
whole ladder: idle, then 1, 10, 50, 100, 200, 500, 1000 requests/s from
bench/loadgen (10 keep-alive connections), --seconds a rung after 1 s of
warm-up, --passes times (medians; peaks are the largest). Per rung: the
capture's CPU (user+sys of nettap, millicores: what a container's CPU
accounting charges it), the kernel time of nettap's BPF programs
(nettap_bpf_program_run_time_seconds_total, millicores: charged to the
processes whose calls ran them, not to nettap) and its ratio to the
capture's CPU (the document's "roughly 2.6 times"), the capture's peak RSS
(VmHWM, reset each rung by /proc/PID/clear_refs) and with its BPF maps
(nettap_bpf_map_memory_bytes: a memory cgroup charges them to the
container), the ingest's CPU and peak RSS, records drained a second,
records lost (ring drops, sink losses, ingest losses), and the app's CPU
(where Go's TLS uprobe traps land).

Section `overhead`, the overhead document's workloads 1, 3 and 4 (001),
on nginx (bench/overhead.py's, with sendfile off: an application writes
its answers, so both ends' bytes are captured chunks) under bench/loadgen:
  1   ~800 requests/s, 10 keep-alive connections (an I/O-bound web API)
  3   15,000 requests/s, a new connection each (50 at once), and the same
      rate on 50 keep-alive connections (high-frequency microservices)
  4   2,200 requests/s on 10 persistent connections (middleware)
Each runs overhead.py's cases A (no nettap), C (capturing nginx's port,
jsonl) and D (C with bpfStats), alternated --reps times, and prints
overhead.py's lines and summary; then beside the document's figures: the
additional CPU (nettap's CPU in C plus the BPF kernel time in D, % of one
core), the p50 and p99 deltas against A (with the A/A spread), the BPF map
memory and nettap's peak RSS.

Writes bench/out/seeds.png: capture CPU and memory against the rate,
nettap beside the document. Root, nginx and nats-server are needed
(scripts/setup.sh bench), and Go 1.19 (scripts/setup.sh test).

Run as root:  .venv/bin/python bench/seeds.py [--quick] [--sections ladder,overhead]
              [--rates 0,1,10,50,100,200,500,1000] [--seconds 10] [--passes 3] [--reps 3]
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import overhead  # noqa: E402
from _nettap import (OUT, build, cpu_s, family_sum, free_port, label_values, metrics,  # noqa: E402
                     start_ingest, start_nettap, status_mb, stop, tree)

import gobuild  # noqa: E402

# shared/seeds/000, "Observed Resource Usage" (peak per container, a Go HTTP application making outbound
# TLS calls, one captured workload): requests/s (0 = idle) -> (capture CPU m, capture Mi, ingest CPU m,
# ingest Mi).
RESOURCE_DOC = {0: (1, 408, 1, 26), 1: (2, 408, 2, 26), 10: (6, 408, 6, 29), 50: (18, 410, 9, 33),
                100: (68, 417, 16, 40), 200: (91, 421, 38, 60), 500: (208, 429, 87, 153),
                1000: (414, 487, 116, 340)}
# 000, "Measuring Collector CPU Accurately": "kernel time spent in eBPF programs was roughly 2.6 times the
# capture process's own userspace CPU" (one production cluster).
RESOURCE_DOC_RATIO = 2.6

# shared/seeds/001, workloads 1, 3 and 4: (name, rate, connections, a new connection each request, the
# document's figures: additional CPU % per core, p50 delta, p99 delta, eBPF map memory MB, agent memory MB).
# Workload 3's CPU and p99 are "initial config -> after kprobe tuning"; 3 runs twice here (its "frequent
# socket creation" as a new connection each request, and its 15,000 req/s on keep-alive connections).
WORKLOADS = (
    ("1  I/O-bound web API, ~800 req/s", 800, 10, False, ("0.6", "<1 ms", "~2 ms", "18", "64")),
    ("3  microservices, 15,000 req/s, a new connection each", 15000, 50, True,
     ("4.2 -> 1.4", "-", "~8 -> ~2 ms", "41", "89")),
    ("3  microservices, 15,000 req/s, keep-alive", 15000, 50, False, ("4.2 -> 1.4", "-", "~8 -> ~2 ms", "41", "89")),
    ("4  middleware, 2,200 req/s, persistent connections", 2200, 10, False, ("0.7", "<1 ms", "<1 ms", "15", "58")),
)
CASES = ["A", "C", "D"]


def spawn(args: list, tmp: str, name: str, procs: list) -> int:
    """Start a tests/go/gotls server, kept in procs; the port it says it listens on."""
    out = open(os.path.join(tmp, name + ".out"), "w+")
    p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    procs.append(p)
    for _ in range(200):
        out.seek(0)
        line = out.readline()
        if line.startswith("listening"):
            return int(line.split()[1])
        if p.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"{name} did not listen: {open(out.name).read()}")


def start_ladder(a, tmp: str, procs: list) -> dict:
    """The backend and the api app (and their CPU at the top rate before nettap runs: the baseline of the
    app m column), then nats-server, nettap and its ingest; what a rung reads."""
    cert, key = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    exe = gobuild.build("gotls", "plain")
    bport = spawn([exe, "https-server", "-cert", cert, "-key", key], tmp, "backend", procs)
    lad = dict(aport=spawn([exe, "api", "-backend", f"https://127.0.0.1:{bport}"], tmp, "api", procs),
               loadgen=build("loadgen"), lat=os.path.join(tmp, "lat.f64"))
    api = procs[-1].pid
    top = max(int(x) for x in a.rates.split(","))
    c0, t0 = cpu_s(api), time.perf_counter()
    rps = load(lad, top, a.seconds)[0] if top else 0.0
    lad["baseline"] = (top, rps, (cpu_s(api) - c0) / (time.perf_counter() - t0) * 1000)
    nport = free_port()
    procs.append(subprocess.Popen(["nice", "-n", "19", "nats-server", "-js", "-a", "127.0.0.1", "-p", str(nport),
                                   "-sd", os.path.join(tmp, "nats")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    cfg = os.path.join(tmp, "nettap.yaml")
    with open(cfg, "w") as f:
        f.write(f"captures: [{{pid: {api}}}]\ncapture: {{tls: true}}\n"
                f"output: {{type: jsonl, path: {tmp}/capture.jsonl, root: {tmp}, max_bytes: {1 << 32}}}\n"
                "diagnostics: {bpfStats: {enabled: true}}\n"
                f"ingest: {{servers: ['nats://127.0.0.1:{nport}'], node: bench, stream: {{name: SEEDS}}}}\n")
    lad.update(mport=free_port(), iport=free_port())
    procs.append(start_nettap(cfg, lad["mport"]))
    nettap = procs[-1].pid
    procs.append(start_ingest(cfg, lad["iport"]))
    time.sleep(2)
    lad["pids"] = {"nettap": nettap, "ingest": procs[-1].pid, "api": api}
    return lad


def load(lad: dict, rate: int, seconds: float) -> tuple:
    """bench/loadgen at rate requests/s on the api app for 1 + seconds s (10 keep-alive connections):
    (requests/s reached, errors)."""
    r = subprocess.run([lad["loadgen"], "127.0.0.1", str(lad["aport"]), "/call", str(rate), str(seconds),
                        "10", "1", lad["lat"]], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"loadgen: {r.stdout} {r.stderr}")
    f = r.stdout.split()
    return float(f[f.index("rate") + 1]), int(f[f.index("errors") + 1])


def clear_peak(pid: int) -> None:
    """Reset VmHWM to the present RSS (Linux 4.0+, Documentation/filesystems/proc.rst: clear_refs 5)."""
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def rung(a, rate: int, lad: dict) -> dict:
    """One rung: rate requests/s (0: idle) for 1 + a.seconds s; the figures of the window."""
    pids = lad["pids"]
    for name in ("nettap", "ingest"):
        clear_peak(pids[name])
    m0, i0, c0 = metrics(lad["mport"]), metrics(lad["iport"]), {k: cpu_s(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    if rate:
        rps, errors = load(lad, rate, a.seconds)
    else:
        rps, errors = 0.0, 0
        time.sleep(1 + a.seconds)
    time.sleep(0.5)                        # the drain's last wakeup and ingest's last batch inside the window
    wall = time.perf_counter() - t0
    m1, i1, c1 = metrics(lad["mport"]), metrics(lad["iport"]), {k: cpu_s(p) for k, p in pids.items()}
    rt0 = label_values(m0, "nettap_bpf_program_run_time_seconds_total")
    bpf = sum(v - rt0.get(k, 0) for k, v in label_values(m1, "nettap_bpf_program_run_time_seconds_total").items())
    d = lambda m1, m0, n: family_sum(m1, n) - family_sum(m0, n)
    lost = (d(m1, m0, "nettap_ringbuf_drops_total") + d(m1, m0, "nettap_records_lost_total")
            + d(i1, i0, "nettap_ingest_records_lost_total"))
    cpu = {k: (c1[k] - c0[k]) / wall * 1000 for k in pids}
    return dict(rate=rate, rps=rps, errors=errors, cap=cpu["nettap"], ing=cpu["ingest"], app=cpu["api"],
                bpf=bpf / wall * 1000, cap_mb=status_mb(pids["nettap"]), ing_mb=status_mb(pids["ingest"]),
                maps=family_sum(m1, "nettap_bpf_map_memory_bytes") / (1 << 20),
                recs=d(m1, m0, "nettap_ringbuf_records_drained_total") / wall,
                acked=d(i1, i0, "nettap_ingest_records_acked_total") / wall, lost=lost)


def summarize(runs: list) -> dict:
    """One rung's passes: medians of the rates, the largest of the peaks, sums of errors and losses."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out.update({k: max(r[k] for r in runs) for k in ("cap_mb", "ing_mb", "maps")})
    out.update({k: sum(r[k] for r in runs) for k in ("errors", "lost")}, rate=runs[0]["rate"])
    return out


LADDER_HEAD = (f"{'rate':>5}{'req/s':>8}{'cap m':>8}{'(doc)':>6}{'BPF m':>7}{'BPF/cap':>8}{'RSS Mi':>8}{'+maps':>7}"
               f"{'(doc)':>6}{'ing m':>7}{'(doc)':>6}{'ing Mi':>7}{'(doc)':>6}{'rec/s':>7}{'acked/s':>8}{'lost':>6}"
               f"{'err':>5}{'app m':>7}")


def ladder_line(r: dict) -> str:
    doc = RESOURCE_DOC.get(r["rate"], ("-",) * 4)
    ratio = r["bpf"] / r["cap"] if r["cap"] else float("nan")
    return (f"{('idle' if not r['rate'] else r['rate']):>5}{r['rps']:>8.1f}{r['cap']:>8.1f}{doc[0]:>6}"
            f"{r['bpf']:>7.1f}{ratio:>8.2f}{r['cap_mb']:>8.1f}{r['cap_mb'] + r['maps']:>7.1f}{doc[1]:>6}"
            f"{r['ing']:>7.1f}{doc[2]:>6}{r['ing_mb']:>7.1f}{doc[3]:>6}{r['recs']:>7.0f}{r['acked']:>8.0f}"
            f"{r['lost']:>6.0f}{r['errors']:>5}{r['app']:>7.1f}")


def run_ladder(a, tmp: str) -> list:
    rates = [int(x) for x in a.rates.split(",")]
    os.makedirs(tmp)
    procs: list = []
    try:
        lad = start_ladder(a, tmp, procs)
        print(f"== the resource document's table (shared/seeds/000): the Go api app (pid {lad['pids']['api']}), "
              f"TLS out, capture.tls on, bpfStats on, ingest to nats; {a.seconds:g} s a rung after 1 s of "
              f"warm-up, {a.passes} pass(es)\n")
        runs: dict = {r: [] for r in rates}
        for n in range(a.passes):
            print(f"pass {n + 1}\n{LADDER_HEAD}", flush=True)
            for rate in rates:
                runs[rate].append(rung(a, rate, lad))
                print(ladder_line(runs[rate][-1]), flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
    rows = [summarize(runs[r]) for r in rates]
    print(f"\nthe table: medians of {a.passes} pass(es) (peaks: the largest), each beside the document's row (doc)")
    print(LADDER_HEAD)
    for r in rows:
        print(ladder_line(r))
    ratios = [r["bpf"] / r["cap"] for r in rows if r["rate"] and r["cap"]]
    base = lad["baseline"]
    print(f"""
  rate, req/s  asked and reached (loadgen, 10 keep-alive connections to the api app)
  cap m        the capture's CPU, user+sys of nettap, millicores; (doc) the document's Capture CPU
  BPF m        kernel time of nettap's BPF programs, millicores (charged to the callers, not to nettap)
  BPF/cap      BPF m / cap m: the document's is {RESOURCE_DOC_RATIO}x (one production cluster); here \
{min(ratios, default=float('nan')):.2f}-{max(ratios, default=float('nan')):.2f}x under load
  RSS Mi       nettap's peak RSS in the rung, MiB; +maps with its BPF maps; (doc) the document's Capture Mem
  ing m, Mi    nettap ingest's CPU (millicores) and peak RSS; (doc) the document's Ingest CPU and Mem
  rec/s        records drained a second; acked/s records the engine acknowledged to ingest a second
  lost         ring drops + sink losses + ingest losses; err the requests that failed
  app m        the Go api app's CPU (its TLS uprobes' traps and the BPF time of its calls land here); without
               nettap, before it started: {base[2]:.1f} m at {base[0]} req/s ({base[1]:.1f} reached)
""")
    return rows


def map_mib(tmp: str, nport: int, unused: int) -> float:
    """nettap_bpf_map_memory_bytes (MiB) of overhead.py's case C config: its maps are sized at load."""
    mport = free_port()
    p = start_nettap(overhead.write_config(tmp, "C", nport, unused), mport)
    try:
        return family_sum(metrics(mport), "nettap_bpf_map_memory_bytes") / (1 << 20)
    finally:
        stop(p)


def run_workload(a, w: tuple, loadgen: str, tmp: str) -> dict:
    """One of the overhead document's workloads by overhead.py's cases A, C, D; its summary."""
    name, rate, conns, close, doc = w
    ns = argparse.Namespace(rate=rate, seconds=a.run_seconds, warmup=1, connections=conns, close=close,
                            settle=1, reps=a.reps, cases=CASES)
    os.makedirs(tmp)
    nport, unused = free_port(), free_port()
    nginx = overhead.start_nginx(tmp, nport, 1)
    results = []
    print(f"\n== workload {name}: nginx {rate:,} requests/s, "
          + (f"a new connection each ({conns} at once)" if close else f"{conns} keep-alive connections")
          + f", {ns.warmup:g} + {ns.seconds:g} s a run, cases {' '.join(CASES)} alternated x {a.reps}\n")
    print(f"{'run':<7}{overhead.HEAD}")
    try:
        for rep in range(a.reps):
            for case in CASES:
                results.append(overhead.run(ns, case, loadgen, nginx, tmp, nport, unused))
                print(f"{case}{rep + 1:<6}{overhead.fmt(results[-1])}", flush=True)
                for f in os.listdir(tmp):
                    if f.startswith("capture-"):
                        os.unlink(os.path.join(tmp, f))
        maps = map_mib(tmp, nport, unused)
    finally:
        stop(nginx)
    overhead.report(results, ns)
    med = lambda case, k: statistics.median(r[k] for r in results if r["case"] == case)
    spread = lambda k: max(r[k] for r in results if r["case"] == "A") - min(r[k] for r in results if r["case"] == "A")
    return dict(name=name, doc=doc, rate=rate, rps_a=med("A", "rps"), rps=med("C", "rps"),
                cap=med("C", "nettap") * 100, bpf=med("D", "bpf") * 100,
                d50=med("C", "p50") - med("A", "p50"), d99=med("C", "p99") - med("A", "p99"),
                aa50=spread("p50"), aa99=spread("p99"), maps=maps, hwm=med("C", "hwm"),
                rec_req=med("C", "drained") / med("C", "wall") / med("C", "rps"),
                lost=sum(r.get("lost", 0) for r in results), errors=sum(r["errors"] for r in results))


def print_workloads(sums: list) -> None:
    print("\n== the overhead document's workloads (shared/seeds/001) beside nettap's (medians of C and D)\n")
    print(f"{'workload':<52}{'A req/s':>9}{'C req/s':>9}{'add. CPU %':>11}{'(doc)':>12}{'p50 +ms':>10}{'(A/A)':>9}"
          f"{'(doc)':>7}{'p99 +ms':>10}{'(A/A)':>9}{'(doc)':>13}{'maps Mi':>8}{'(doc MB)':>9}{'RSS Mi':>7}"
          f"{'(doc MB)':>9}{'rec/req':>8}{'lost':>7}{'err':>5}")
    for s in sums:
        doc = s["doc"]
        print(f"{s['name']:<52}{s['rps_a']:>9,.0f}{s['rps']:>9,.0f}{s['cap'] + s['bpf']:>11.2f}{doc[0]:>12}"
              f" {s['d50']:>+9.2f} {s['aa50']:>8.2f}{doc[1]:>7} {s['d99']:>+9.2f} {s['aa99']:>8.2f}{doc[2]:>13}"
              f"{s['maps']:>8.1f}{doc[3]:>9}{s['hwm']:>7.1f}{doc[4]:>9}{s['rec_req']:>8.2f} {s['lost']:>6.0f}"
              f"{s['errors']:>5}")
    print("""
  A, C req/s   requests/s reached without nettap (A) and capturing (C), medians
  add. CPU %   nettap's CPU (case C, user+sys) + its BPF programs' kernel time (case D), % of one core;
               (doc) the document's "additional CPU (per core)", workload 3's before -> after its tuning
  p50, p99     C's latency percentiles less A's, ms; (A/A) the spread between the A runs (the noise);
               (doc) the document's "latency delta"
  maps Mi      nettap_bpf_map_memory_bytes of case C's config; RSS Mi nettap's peak RSS (C);
               (doc) the document's "eBPF map memory (kernel)" and "Agent pod memory (userspace)"
  rec/req      records a request (C); lost, err over every run of the workload""")
    for s in sums:
        print(f"  {s['name'][:2].strip()}: nettap {s['cap']:.2f} % + BPF {s['bpf']:.2f} % of a core "
              f"({s['name'][3:]})")
        if s["rps_a"] < 0.95 * s["rate"]:
            print(f"     A reached {s['rps_a']:,.0f} of {s['rate']:,} req/s without nettap: this machine did not "
                  "carry the load, so its latencies (queueing) and deltas say nothing of nettap")


def run_overhead(a, tmp: str) -> list:
    # bench/overhead.py's nginx, with sendfile off: an application writes its answers (the body a chunk
    # of nginx's socket as well as of the client's), as the document's web API, services and middleware do.
    overhead.NGINX_CONF = overhead.NGINX_CONF.replace("sendfile on;", "sendfile off;")
    loadgen = build("loadgen")
    sums = [run_workload(a, w, loadgen, os.path.join(tmp, f"w{i}")) for i, w in enumerate(WORKLOADS)]
    print_workloads(sums)
    return sums


def plot(rows: list, path: str) -> None:
    """Capture CPU and memory against the rate, nettap's beside the document's."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(no plot: matplotlib is not installed; pip install -e .[bench])")
        return
    x = range(len(rows))
    doc = [RESOURCE_DOC.get(r["rate"], (float("nan"),) * 4) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    ax1.plot(x, [d[0] for d in doc], "o--", color="tab:gray", label="document: capture CPU")
    ax1.plot(x, [r["cap"] for r in rows], "o-", color="tab:orange", label="nettap: capture CPU (user+sys)")
    ax1.plot(x, [r["bpf"] for r in rows], "s-", color="tab:red", label="nettap: its BPF programs' kernel time")
    ax1.plot(x, [d[2] for d in doc], "^--", color="silver", label="document: ingest CPU")
    ax1.plot(x, [r["ing"] for r in rows], "^-", color="tab:green", label="nettap ingest CPU")
    ax1.set_ylabel("millicores")
    ax1.set_title("CPU")
    ax2.plot(x, [d[1] for d in doc], "o--", color="tab:gray", label="document: capture memory")
    ax2.plot(x, [r["cap_mb"] + r["maps"] for r in rows], "o-", color="tab:orange",
             label="nettap: peak RSS + BPF maps")
    ax2.plot(x, [r["cap_mb"] for r in rows], "o:", color="tab:orange", label="nettap: peak RSS")
    ax2.plot(x, [d[3] for d in doc], "^--", color="silver", label="document: ingest memory")
    ax2.plot(x, [r["ing_mb"] for r in rows], "^-", color="tab:green", label="nettap ingest: peak RSS")
    ax2.set_ylabel("MiB")
    ax2.set_title("memory (peak in each rung)")
    for ax in ax1, ax2:
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels(["idle" if not r["rate"] else str(r["rate"]) for r in rows])
        ax.set_xlabel("requests/s (the Go api app, one outbound TLS call each)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax2.set_yticks([20, 30, 50, 100, 200, 300, 500])
    fig.suptitle(f"the resource document's table (shared/seeds/000) beside nettap ({os.cpu_count()} CPUs, "
                 f"kernel {os.uname().release})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot of capture CPU and memory against the rate: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="ladder,overhead", help="ladder, overhead or both (both)")
    ap.add_argument("--quick", action="store_true",
                    help="rungs idle,10,100,1000 of 5 s, one pass; one rep of 5 s a case (about 4 min)")
    ap.add_argument("--rates", default="0,1,10,50,100,200,500,1000", help="the ladder's rungs, requests/s")
    ap.add_argument("--seconds", type=float, default=10, help="recorded seconds of a rung (10)")
    ap.add_argument("--passes", type=int, default=3, help="passes over the ladder (3)")
    ap.add_argument("--reps", type=int, default=3, help="times each overhead case runs, alternated (3)")
    ap.add_argument("--run-seconds", type=float, default=10, help="recorded seconds of an overhead run (10)")
    ap.add_argument("--plot", default=os.path.join(OUT, "seeds.png"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    sections = set(a.sections.split(","))
    if not sections or sections - {"ladder", "overhead"}:
        raise SystemExit("--sections: ladder, overhead or ladder,overhead")
    if a.quick:
        a.rates, a.seconds, a.passes, a.reps, a.run_seconds = "0,10,100,1000", 5, 1, 1, 5
    for exe, why in (("nginx", "scripts/setup.sh bench"), ("nats-server", "scripts/setup.sh bench")):
        if not (shutil.which(exe) or os.path.exists(f"/usr/sbin/{exe}")):
            raise SystemExit(f"{exe} is not installed: run {why}")
    tmp = tempfile.mkdtemp(prefix="nettap-seeds-")
    os.chmod(tmp, 0o755)                      # nginx's workers drop root
    t0 = time.monotonic()
    try:
        if "ladder" in sections:
            rows = run_ladder(a, os.path.join(tmp, "ladder"))
            plot(rows, a.plot)
        if "overhead" in sections:
            run_overhead(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{time.monotonic() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
