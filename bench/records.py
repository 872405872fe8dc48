#!/usr/bin/env python3
"""Lines and JSON bytes per request on a new connection, by record kind, for
capture.records: every kind but segment (the baseline: what nettap
published before capture.records), the default, and chunk + eof alone, measured in one run
on one nettap, reconfigured between them as a reload does.

The workload, each request: a loopback connection, both ends captured (a
port target), one request of --size bytes, one answer of --size bytes, the
client closes first, then the server. Run as root from the checkout:

    .venv/bin/python bench/records.py [--requests 200] [--size 64]
"""
import argparse
import collections
import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from exporter import config  # noqa: E402
from exporter.commands.daemon import Nettap  # noqa: E402

# The baseline: what nettap published before capture.records (every kind but segment, which a
# target asked for with segments: true; records: all asks for every target's segments too).
SETS = (("before (all - segment)", [k for k in config.RECORD_KINDS if k != "segment"]),
        ("default", list(config.DEFAULT_RECORDS)), ("chunk+eof", ["chunk", "eof"]))


def serve(lst, n, size):
    for _ in range(n):
        c, _ = lst.accept()
        got = b""
        while len(got) < size:
            got += c.recv(65536)
        c.sendall(b"a" * size)
        c.recv(1)                       # the client's FIN
        c.close()


def requests(port, lst, n, size):
    t = threading.Thread(target=serve, args=(lst, n, size))
    t.start()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"q" * size)
        got = b""
        while len(got) < size:
            got += s.recv(65536)
        s.close()
    t.join()


def quiet(app, timeout=30.0):
    """Until every record published so far is written: each ring empty, and
    the sink has what the drain took (twice in a row)."""
    end, settled = time.monotonic() + timeout, 0
    while settled < 2:
        if time.monotonic() > end:
            raise SystemExit("records: the rings and the sink did not settle")
        pipe, totals = app.pipeline, app.sink_totals
        done = sum(totals.written.values()) + totals.lost + pipe.lost["queue"] + pipe.lost["decode"]
        empty = all(r.pending_bytes() == 0 for r in app.rings.values())
        settled = settled + 1 if empty and done >= sum(r.drained for r in app.rings.values()) else 0
        time.sleep(0.01)


def count(path, offset, port):
    """(lines, JSON bytes) by kind of the lines about port written since offset."""
    lines, nbytes = collections.Counter(), collections.Counter()
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            rec = json.loads(raw)
            if port in (rec.get("sport"), rec.get("dport")):
                lines[rec["type"]] += 1
                nbytes[rec["type"]] += len(raw)
    return lines, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--size", type=int, default=64)
    a = ap.parse_args()
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(128)
    port = lst.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="nettap-records-")
    out = os.path.join(tmp, "capture.jsonl")
    base = {"captures": [{"port": port}], "output": {"type": "jsonl", "path": out, "root": tmp}}
    app = Nettap(config.parse({**base, "capture": {"records": SETS[0][1]}}))
    results = {}
    try:
        for name, records in SETS:
            app.apply(config.parse({**base, "capture": {"records": records}}))
            quiet(app)
            offset = os.path.getsize(out) if os.path.exists(out) else 0
            requests(port, lst, a.requests, a.size)
            time.sleep(0.1)             # the last sockets' ends
            quiet(app)
            results[name] = count(out, offset, port)
    finally:
        app.close()
        lst.close()
    kinds = sorted({k for lines, _ in results.values() for k in lines},
                   key=lambda k: -results[SETS[0][0]][0].get(k, 0))
    n = a.requests
    print(f"{n} requests on new connections, both ends captured, {a.size}-byte request and answer; "
          "lines (JSON bytes) per request")
    print(f"{'kind':<20}" + "".join(f"{name:>22}" for name, _ in SETS))
    for k in kinds + ["all"]:
        row = f"{k:<20}"
        for name, _ in SETS:
            lines, nbytes = results[name]
            ln = sum(lines.values()) if k == "all" else lines.get(k, 0)
            nb = sum(nbytes.values()) if k == "all" else nbytes.get(k, 0)
            row += f"{ln / n:>12.2f} ({nb / n:>6.0f} B)"
        print(row)


if __name__ == "__main__":
    main()
