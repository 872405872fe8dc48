#!/usr/bin/env python3
"""DNS benchmark: nettap's DNS capture (capture.dns) under a client sending
N UDP queries a second to a resolver of its own, each figure printed beside
a baseline from the same run (the same load without nettap).

  queries sent and answered     vs. the baseline run's
  dns records drained, dropped  (a query and its answer: 2 records each)
  rcode counts                  every query answered must be counted by its
                                rcode; one whose answer the ring dropped is
                                lost, never a timeout

Run as root:  .venv/bin/python bench/dns.py [--rate 10000] [--seconds 5]
The resolver and the client (tests/dnsload.py) run in a network namespace of
their own; nettap runs as its own process (the real CLI), with a pid target on
the client; its figures are read from its /metrics endpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))     # the test suite's load generator
from _nettap import free_port, label_values, metrics, start_nettap, stop  # noqa: E402
import dnsload  # noqa: E402


def one_run(ns: str, a, mport: int = 0, cfg: str = "") -> dict:
    """One load; with mport, nettap on that port targets the client."""
    client = dnsload.start(ns, ["ask", "--rate", str(a.rate), "--seconds", str(a.seconds),
                                "--sockets", str(a.sockets), "--tick", str(a.tick)])
    if mport:
        with open(cfg, "w") as f:
            f.write(CONFIG.format(pid=client.pid, rings=RINGS[0]))
        os.kill(nettap_pid[0], 1)                           # SIGHUP: the config names the client now
        time.sleep(1.0)
        before = metrics(mport)
    out = dnsload.finish(client)
    if mport:
        time.sleep(6.5)                                     # past the tracker's timeout (5 s)
        after = metrics(mport)
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        out["drained"] = int(label_values(d, "nettap_ringbuf_records_drained_total").get("dns", 0))
        out["dropped"] = int(label_values(d, "nettap_ringbuf_drops_total").get("dns", 0))
        out["rcodes"] = {k: int(v) for k, v in label_values(d, "nettap_dns_queries_total").items() if v}
        out["unmatched"] = int(d.get("nettap_dns_responses_unmatched_total", 0))
    return out


CONFIG = """captures:
  - pid: {pid}
capture:
  dns: true
output:
  type: none
{rings}"""
nettap_pid = [0]
RINGS = [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=10000)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--sockets", type=int, default=8)
    ap.add_argument("--tick", type=float, default=0.001, help="seconds between two bursts of queries")
    ap.add_argument("--ring-bytes", type=int, default=0, help="rings.dns (default: nettap's)")
    a = ap.parse_args()
    RINGS[0] = f"rings:\n  dns: {a.ring_bytes}\n" if a.ring_bytes else ""
    from pyroute2 import NetNS, netns
    ns = f"nettap-bench-{uuid.uuid4().hex[:8]}"
    netns.create(ns)
    server = None
    nt = None
    try:
        with NetNS(ns) as n:
            n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
        server = dnsload.start(ns, ["serve"])
        base = one_run(ns, a)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = os.path.join(tmp, "nettap.yaml")
            with open(cfg, "w") as f:
                f.write("captures: []\ncapture:\n  dns: true\noutput:\n  type: none\n" + RINGS[0])
            mport = free_port()
            nt = start_nettap(cfg, mport)
            nettap_pid[0] = nt.pid
            run = one_run(ns, a, mport, cfg)
    finally:
        if nt:
            stop(nt)
        if server:
            dnsload.finish(server)
        netns.remove(ns)
    answered = sum(run["rcodes"].get(k, 0) for k in run["rcodes"] if k not in ("timeout", "lost"))
    print(f"dns load: {a.rate:g} queries/s for {a.seconds:g} s, {a.sockets} sockets, bursts every "
          f"{a.tick * 1000:g} ms (baseline: the same load, no nettap)")
    print(f"  queries sent       {run['sent']:>9}   baseline {base['sent']:>9}")
    print(f"  answered (client)  {run['answered']:>9}   baseline {base['answered']:>9}")
    print(f"  records drained    {run['drained']:>9}   (2 a query: {2 * run['sent']})")
    print(f"  records dropped    {run['dropped']:>9}   ({100 * run['dropped'] / max(1, 2 * run['sent']):.1f} %)")
    print(f"  counted answered   {answered:>9}")
    print(f"  counted lost       {run['rcodes'].get('lost', 0):>9}")
    print(f"  counted timeout    {run['rcodes'].get('timeout', 0):>9}   (client unanswered: "
          f"{run['sent'] - run['answered']})")
    print(f"  answers unmatched  {run['unmatched']:>9}   (their query's record dropped)")
    print(f"  rcodes             {run['rcodes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
