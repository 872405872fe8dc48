#!/usr/bin/env python3
"""The HTTP endpoint under load: scrape latency (connect to last byte, a
new connection each) of the real exporter for one scraper alone (the
baseline, same run), for 200 scrapers at once, and for one scraper while
2,000 idle connections are open to it.

Run as root:  .venv/bin/python bench/http_load.py [--scrapers 200] [--idle 2000] [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _nettap import free_port, start_nettap, stop  # noqa: E402

CONFIG = ("captures: [{port: 1}]\noutput: {type: none}\n"
          "diagnostics: {bpfStats: {enabled: true, scope: node}}\n")


def scrape(port: int, timeout: float = 30.0, headers: str = ""):
    """Seconds for one GET /metrics on a new connection (with extra header
    lines, each ending in CRLF), or the error."""
    t = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: bench\r\n{headers}Connection: close\r\n\r\n".encode())
            first = s.recv(65536)
            while s.recv(65536):
                pass
    except OSError as e:
        return type(e).__name__
    if not first.startswith(b"HTTP/1.1 200 "):
        return first.split(b"\r\n", 1)[0].decode()
    return time.perf_counter() - t


def pct(xs: list, p: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


def line(name: str, results: list) -> str:
    ok = [r for r in results if isinstance(r, float)]
    bad = len(results) - len(ok)
    return (f"{name:<38} {pct(ok, 50) * 1e3:8.1f} ms {pct(ok, 99) * 1e3:9.1f} ms   "
            f"{len(results):5d} scrapes, {bad} failed")


def concurrent(port: int, scrapers: int, rounds: int) -> list:
    go = threading.Barrier(scrapers)
    out: list = []

    def one():
        for _ in range(rounds):
            go.wait()
            out.append(scrape(port))
    threads = [threading.Thread(target=one) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapers", type=int, default=200)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10, help="scrapes per scraper")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, a.idle + 1024)), hard))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "nettap.yaml")
        with open(cfg, "w") as f:
            f.write(CONFIG)
        p = start_nettap(cfg, port)
        try:
            size = len(open_scrape(port))
            scrape(port)                                  # warm
            alone = [scrape(port) for _ in range(a.scrapers)]
            many = concurrent(port, a.scrapers, a.rounds)
            t = time.perf_counter()
            idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(a.idle)]
            opened = time.perf_counter() - t
            try:
                # Inside the 10 s header timeout: the idle ones are all still open.
                with_idle = [scrape(port) for _ in range(a.scrapers)]
                during = time.perf_counter() - t
                gone = wait_closed(idle, 30, t)
            finally:
                for s in idle:
                    s.close()
            closed = metric(port, 'nettap_http_connections_rejected_total{reason="header_timeout"}')
        finally:
            stop(p)
    print(f"\nnettap HTTP benchmark (/metrics of {size} bytes, a new connection per scrape, "
          f"connect to last byte)\n")
    print(f"{'':<38} {'p50':>11} {'p99':>12}")
    print(line("one scraper (baseline)", alone))
    print(line(f"{a.scrapers} scrapers at once", many))
    print(line(f"one scraper, {a.idle} idle connections", with_idle))
    print(f"\n{a.idle} idle connections opened in {opened:.2f} s; the scrapes beside them done "
          f"{during:.2f} s after the first opened; nettap closed {gone[0]} of them by "
          f"{gone[1]:.1f} s (nettap_http_connections_rejected_total{{reason=\"header_timeout\"}} {closed:.0f})")


def wait_closed(socks: list, seconds: float, t0: float):
    """(how many of socks the server closed within seconds, seconds from t0
    to the last of them)."""
    t, n, last = time.perf_counter(), 0, 0.0
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while n < len(socks) and time.perf_counter() - t < seconds:
            for key, _ in sel.select(1.0):
                try:
                    key.fileobj.recv(1)
                except OSError:
                    pass
                sel.unregister(key.fileobj)
                n += 1
                last = time.perf_counter() - t0
    return n, last


def open_scrape(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return buf.split(b"\r\n\r\n", 1)[1]
            buf += chunk


def metric(port: int, sample: str) -> float:
    for l in open_scrape(port).decode().splitlines():
        if l.startswith(sample + " "):
            return float(l.rsplit(" ", 1)[1])
    return float("nan")


if __name__ == "__main__":
    main()
