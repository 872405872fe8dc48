#!/usr/bin/env python3
"""The HTTP endpoint under abuse, with basic auth on (a bcrypt hash of cost
10, as `htpasswd -nBC 10` makes): one legitimate scraper's latency (connect
to last byte, a new connection each, every 50 ms) alone (the baseline, same
run), while 300 connections pipeline 50 requests each with wrong passwords
and never read, and
while 16 connections with a 1 KiB receive buffer pipeline /metrics and never
read; nettap's CPU (user + system, /proc/PID/stat) over each phase.

Run as root:  .venv/bin/python bench/http_abuse.py [--seconds 10]
"""
from __future__ import annotations

import argparse
import base64
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _nettap import free_port, start_nettap, stop  # noqa: E402
import http_load  # noqa: E402
from http_load import pct  # noqa: E402

AUTH = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()


def scrape(port: int):
    return http_load.scrape(port, headers=f"Authorization: {AUTH}\r\n")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase(name, port, pid, seconds, abuse=None):
    """(name, scrape results, nettap's CPU share) over seconds in which one
    scraper asks every 50 ms while abuse(stop) runs in a thread."""
    stop = threading.Event()
    t = threading.Thread(target=abuse, args=(port, stop), daemon=True) if abuse else None
    if t:
        t.start()
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    results = []
    while time.perf_counter() - t0 < seconds:
        results.append(scrape(port))
        time.sleep(0.05)
    share = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
    stop.set()
    if t:
        t.join(30)
    return name, results, share


def password_flood(port, stop):
    """300 connections, each pipelining 50 requests with wrong passwords
    (each connection its own, so no cache helps), never read: held open
    until stop."""
    socks = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        auth = base64.b64encode(f"prometheus:wrong-{i}".encode()).decode()
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {auth}\r\n\r\n".encode() * 50)
        socks.append(s)
    stop.wait()
    for s in socks:
        s.close()


def slow_readers(port, stop):
    """16 connections with a 1 KiB receive buffer pipelining /metrics, never
    read; each one nettap closes is opened again, until stop."""
    socks = []
    while not stop.is_set():
        while len(socks) < 16:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.connect(("127.0.0.1", port))
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n\r\n".encode() * 20)
            socks.append(s)
        stop.wait(0.5)
        for s in list(socks):                       # closed by nettap (write timeout): replaced
            try:
                s.setblocking(False)
                if s.recv(1, socket.MSG_PEEK) == b"":
                    socks.remove(s)
                    s.close()
            except BlockingIOError:
                pass
            except OSError:
                socks.remove(s)
                s.close()
    for s in socks:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    import bcrypt
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg, web = os.path.join(tmp, "nettap.yaml"), os.path.join(tmp, "web.yml")
        with open(cfg, "w") as f:
            f.write("captures: [{port: 1}]\noutput: {type: none}\n")
        with open(web, "w") as f:
            f.write(f"basic_auth_users: {{prometheus: '{bcrypt.hashpw(b's3cret', bcrypt.gensalt(10)).decode()}'}}\n")
        p = start_nettap(cfg, port, extra=["--web.config.file", web], auth=AUTH)
        try:
            scrape(port)                               # the password checked once, then cached
            rows = [phase("one scraper (baseline)", port, p.pid, a.seconds),
                    phase("beside a wrong-password flood", port, p.pid, a.seconds, password_flood),
                    phase("beside 16 clients that do not read", port, p.pid, a.seconds, slow_readers)]
        finally:
            stop(p)
    print("\nnettap HTTP endpoint under abuse (basic auth, bcrypt cost 10; a new connection per scrape)\n")
    print(f"{'':<36} {'p50':>9} {'p99':>10} {'nettap CPU':>11}")
    for name, results, share in rows:
        ok = [r for r in results if isinstance(r, float)]
        bad = sorted({r for r in results if not isinstance(r, float)})
        p50, p99 = ((f"{pct(ok, 50) * 1e3:6.1f} ms", f"{pct(ok, 99) * 1e3:7.1f} ms") if ok
                    else ("     -   ", "      -   "))
        print(f"{name:<36} {p50} {p99} {share * 100:9.0f} %   "
              f"{len(results)} scrapes, {len(results) - len(ok)} failed" + (f" ({', '.join(bad)})" if bad else ""))


if __name__ == "__main__":
    main()
