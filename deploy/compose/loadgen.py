#!/usr/bin/env python3
"""A load generator at a fixed request rate, standard library only.

    python loadgen.py --url http://web:8000/ --rate 20

Sends one HTTP GET every 1/rate seconds, each on a new TCP connection (so
every request is a connect, a send, a receive and a close: the TCP send,
receive and state-change paths nettap probes). The schedule is absolute
(request i is due at start + i/rate), so a slow response delays the next
request but does not lower the average rate; when it falls behind by more
than a second it skips ahead rather than bursting. Prints one summary line
every --report seconds. Runs until killed, or for --duration seconds.

Used by the docker-compose workload (deploy/compose/) and by the local demo
(scripts/demo.py), inside its network namespace.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
import urllib.error
import urllib.request


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/", help="URL to GET (default %(default)s)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (default %(default)s)")
    p.add_argument("--timeout", type=float, default=2.0, help="per-request timeout in seconds")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: run until killed)")
    p.add_argument("--report", type=float, default=30.0, help="seconds between summary lines (0: none)")
    args = p.parse_args(argv)
    if args.rate <= 0:
        p.error("--rate must be > 0")

    # SIGTERM (docker stop, the demo's shutdown) ends the loop like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    period = 1.0 / args.rate
    start = time.monotonic()
    end = start + args.duration if args.duration > 0 else float("inf")
    next_report = start + args.report if args.report > 0 else float("inf")
    ok = errors = 0
    i = 0
    print(f"loadgen: GET {args.url} at {args.rate:g} req/s", flush=True)
    try:
        while True:
            due = start + i * period
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            elif now - due > 1.0:              # fell behind: skip, do not burst
                i = int((now - start) / period)
            if time.monotonic() >= end:
                break
            try:
                with urllib.request.urlopen(args.url, timeout=args.timeout) as r:
                    r.read()
                ok += 1
            except (OSError, urllib.error.URLError):
                errors += 1
            i += 1
            if time.monotonic() >= next_report:
                elapsed = time.monotonic() - start
                print(f"loadgen: {ok} ok, {errors} errors in {elapsed:.0f}s ({ok / elapsed:.1f} req/s)", flush=True)
                next_report += args.report
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
