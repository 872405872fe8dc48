#!/usr/bin/env python3
"""Storm benchmark: nettap under the heaviest loopback send storm this
machine makes, each figure printed beside a baseline from the same run.

  records/s drained, records lost   vs. the storm's send rate without nettap
  user CPU s per million records    vs. nettap idle over as long
  start time (load+verify+attach)   vs. a bare interpreter start
  idle RSS                          vs. a bare interpreter's RSS

Run as root:  .venv/bin/python bench/storm.py [--seconds 5] [--senders 2]
  the start and the idle RSS alone:  .venv/bin/python bench/storm.py --idle
The exporter runs as its own process (the real CLI), its figures read from
/proc and from its /metrics endpoint.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MSG = b"x" * 64
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the storm -----------------------------------------------------------

def _server(port: int, ready) -> None:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(64)
    ready.set()
    import threading

    def reader(c):
        while c.recv(1 << 20):
            pass
        c.close()
    while True:
        c, _ = ls.accept()
        threading.Thread(target=reader, args=(c,), daemon=True).start()


def _sender(port: int, seconds: float, out) -> None:
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect(("127.0.0.1", port))
    send = s.send
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            send(MSG)
        n += 1000
    s.close()
    out.put(n)


def storm(port: int, seconds: float, senders: int) -> tuple[int, float]:
    """(sends, elapsed seconds) of `senders` processes sending 64-byte messages."""
    q = mp.Queue()
    ps = [mp.Process(target=_sender, args=(port, seconds, q)) for _ in range(senders)]
    t = time.perf_counter()
    for p in ps:
        p.start()
    total = sum(q.get() for _ in ps)
    for p in ps:
        p.join()
    return total, time.perf_counter() - t


# ---- reading the exporter ------------------------------------------------

def metrics(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(nettap_\w+)(\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def cpu(pid: int) -> tuple[float, float]:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) / TICK, int(f[12]) / TICK       # utime, stime


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_nettap(cfg: str, mport: int) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-m", "exporter", "--config", cfg, "--web.listen-address", f"127.0.0.1:{mport}",
                          "--log.level", "warning"], cwd=ROOT)
    for _ in range(200):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=1).status == 200:
                return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit("nettap did not become ready")


LOSS = ("nettap_ringbuf_drops_total", "nettap_records_lost_total")


def lost(m: dict) -> int:
    return int(sum(v for k, v in m.items() if k.startswith(LOSS)))


def lost_where(m1: dict, m0: dict) -> str:
    parts = [f"{k.split('{')[1].rstrip('}')} {int(v - m0.get(k, 0))}" for k, v in sorted(m1.items())
             if k.startswith(LOSS) and v - m0.get(k, 0)]
    return ", ".join(parts)


def drained(m: dict) -> int:
    return int(m['nettap_ringbuf_records_drained_total{ring="capture_chunks"}'])


def first_line(cmd, runs: int = 7) -> float:
    """Median seconds from spawning cmd to its first line on stdout."""
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        p.stdout.readline()
        ts.append(time.perf_counter() - t)
        p.wait()
    return statistics.median(ts)


def ready_time(cfg: str, runs: int = 5) -> float:
    """Median seconds from spawning nettap to its /readyz answering 200."""
    ts = []
    for _ in range(runs):
        port = free_port()
        t = time.perf_counter()
        p = subprocess.Popen([PY, "-m", "exporter", "--config", cfg, "--web.listen-address", f"127.0.0.1:{port}",
                              "--log.level", "warning"], cwd=ROOT)
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.005)
        ts.append(time.perf_counter() - t)
        p.terminate()
        p.wait(30)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--idle", action="store_true", help="only the start times and the idle RSS")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")

    port, mport = free_port(), free_port()
    ev = mp.Event()
    srv = mp.Process(target=_server, args=(port, ev), daemon=True)
    srv.start()
    ev.wait()
    tmp = tempfile.mkdtemp(prefix="nettap-bench-")
    rows = []

    # 1. the storm alone
    base_sends, base_t = storm(port, a.seconds, a.senders) if not a.idle else (0, 1)
    base_rate = base_sends / base_t

    # 2. the storm captured, sink none (the drain alone) and sink jsonl
    for sink in ("none", "jsonl") if not a.idle else ():
        cfg = os.path.join(tmp, f"{sink}.yaml")
        out = (f"{{type: jsonl, path: {tmp}/capture.jsonl, root: {tmp}, max_bytes: 1073741824}}" if sink == "jsonl"
               else "{type: none}")
        with open(cfg, "w") as f:
            f.write(f"captures: [{{port: {port}}}]\noutput: {out}\n")
        p = start_nettap(cfg, mport)
        try:
            time.sleep(1)
            u0, s0 = cpu(p.pid)
            time.sleep(a.seconds)                      # idle baseline, same length
            u1, s1 = cpu(p.pid)
            m0 = metrics(mport)
            sends, t = storm(port, a.seconds, a.senders)
            deadline = time.time() + 30                # post-load drain
            while time.time() < deadline:
                m1 = metrics(mport)
                calls = (m1['nettap_probe_calls_total{probe="tcp_sendmsg"}']
                         - m0['nettap_probe_calls_total{probe="tcp_sendmsg"}'])
                if calls >= sends and sum(v for k, v in m1.items()
                                          if k.startswith("nettap_ringbuf_pending_bytes")) == 0:
                    break
                time.sleep(0.2)
            time.sleep(1 if sink == "none" else 3)
            m1 = metrics(mport)
            u2, s2 = cpu(p.pid)
        finally:
            p.terminate()
            p.wait(30)
        recs = drained(m1) - drained(m0)
        chunks = sum(m1[f'nettap_probe_chunks_published_total{{probe="{pr}"}}']
                     - m0[f'nettap_probe_chunks_published_total{{probe="{pr}"}}']
                     for pr in ("tcp_sendmsg", "tcp_recvmsg"))
        drops = lost(m1) - lost(m0)
        rows.append((sink, sends / t, recs / t, recs, chunks, drops, (u2 - u1), (u1 - u0), lost_where(m1, m0)))

    # 3. start time and idle RSS
    cfg = os.path.join(tmp, "idle.yaml")
    with open(cfg, "w") as f:
        f.write("captures: []\n")
    # nettap --preflight prints its first line once every probe is attached.
    t_bare = first_line([PY, "-c", "print('up', flush=True)"])
    t_start = first_line([PY, "-m", "exporter", "--preflight", "--config", cfg])
    t_ready = ready_time(cfg)
    bare = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    p = start_nettap(cfg, mport)
    time.sleep(3)
    idle_rss, bare_rss = rss_mb(p.pid), rss_mb(bare.pid)
    parts = {f: rss_mb(p.pid, f) for f in ("RssAnon", "RssFile", "RssShmem")}
    p.terminate()
    p.wait(30)
    bare.kill()
    bare.wait()
    srv.kill()

    print(f"\nnettap storm benchmark ({a.senders} sender processes x {a.seconds:.0f} s, 64-byte sends, "
          f"{os.cpu_count()} CPUs, kernel {os.uname().release})\n")
    if not a.idle:
        print(f"baseline: the storm without nettap           {base_rate:12,.0f} sends/s")
    for sink, srate, rrate, recs, chunks, drops, ucpu, uidle, where in rows:
        print(f"\nsink={sink}")
        print(f"  storm with nettap capturing it             {srate:12,.0f} sends/s  "
              f"({srate / base_rate:.2f}x baseline)")
        print(f"  records drained                            {rrate:12,.0f} records/s ({recs:,} records)")
        print(f"  records lost (ring drops + user space)     {drops:12,}        "
              f"(published {int(chunks):,}, drained {recs:,})")
        if where:
            print(f"    where: {where}")
        per_m = ucpu / recs * 1e6 if recs else float('nan')
        print(f"  user CPU per million records               {per_m:12.3f} s     "
              f"(idle baseline: {uidle:.3f} s user over {a.seconds:.0f} s)")
    print(f"\nstart to attached (median of 7)             {t_start:12.3f} s     "
          f"(bare interpreter start: {t_bare:.3f} s, +{t_start - t_bare:.3f} s)")
    print(f"start to /readyz 200 (median of 5)          {t_ready:12.3f} s     (probes attached, drain and endpoint up)")
    print(f"idle RSS                                   {idle_rss:12.1f} MB    (bare interpreter: {bare_rss:.1f} MB; "
          + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")")


if __name__ == "__main__":
    main()
