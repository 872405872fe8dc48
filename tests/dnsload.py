"""A DNS load generator for the kernel tests and bench/dns.py: a UDP
resolver that answers every query (NOERROR, the question echoed), and a
client that sends N queries a second from a few unconnected sockets
(sendto/recvfrom, as dnspython and musl ask) and counts the answers it got.

Each runs as its own process (python tests/dnsload.py serve|ask ...), so
neither takes the interpreter lock of a nettap running in the caller's
process:

  serve --port 53                     answers until stdin closes
  ask --rate 500 --seconds 2          waits for a line on stdin, then asks;
      [--sockets 8] [--tick 0.001]         prints {"sent": N, "answered": M}
      [--server 127.0.0.1]

serve and ask are started in a network namespace with :func:`in_netns_cmd`.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
# The answer's flags: QR, RD and RA set, NOERROR (RFC 1035 4.1.1).
ANSWER_FLAGS = 0x8180


def query_wire(qid: int, name: bytes = b"\x04load\x07example\x00") -> bytes:
    """A query for name's A record, id qid, recursion desired."""
    return struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + name + b"\x00\x01\x00\x01"


def serve(port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("127.0.0.1", port))
    s.setblocking(False)
    print("ready", flush=True)
    poll = select.poll()
    poll.register(s, select.POLLIN)
    poll.register(sys.stdin, select.POLLIN | select.POLLHUP)
    while True:
        for fd, _ in poll.poll(1000):
            if fd != s.fileno():
                return                                  # stdin closed or written: stop
            while True:
                try:
                    wire, peer = s.recvfrom(512)
                except BlockingIOError:
                    break
                if len(wire) >= 12:
                    s.sendto(wire[:2] + ANSWER_FLAGS.to_bytes(2, "big") + wire[4:], peer)


def ask(rate: float, seconds: float, nsocks: int, server: str, port: int, tick: float = 0.001) -> dict:
    """rate queries a second for seconds, round robin over nsocks sockets,
    sent in bursts every tick seconds (those due since the last); then 1 s
    more for the last answers."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(nsocks)]
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.setblocking(False)
    by_fd = {s.fileno(): s for s in socks}
    poll = select.poll()
    for s in socks:
        poll.register(s, select.POLLIN)
    print("ready", flush=True)
    sys.stdin.readline()
    outstanding = [set() for _ in socks]
    sent = answered = 0
    start = time.monotonic()
    end = start + seconds
    total = int(rate * seconds)

    def receive(timeout_ms: int) -> None:
        nonlocal answered
        for fd, _ in poll.poll(timeout_ms):
            s = by_fd[fd]
            i = socks.index(s)
            while True:
                try:
                    wire, _peer = s.recvfrom(512)
                except BlockingIOError:
                    break
                qid = int.from_bytes(wire[:2], "big")
                if qid in outstanding[i]:
                    outstanding[i].discard(qid)
                    answered += 1
    while sent < total:
        due = min(total, int((time.monotonic() - start) // tick * tick * rate) + 1)
        while sent < due:
            i = sent % nsocks
            qid = (sent // nsocks) & 0xFFFF
            outstanding[i].add(qid)
            socks[i].sendto(query_wire(qid), (server, port))
            sent += 1
        left = start + ((time.monotonic() - start) // tick + 1) * tick - time.monotonic()
        receive(max(0, int(left * 1000)))
    deadline = max(end, time.monotonic()) + 1.0
    while answered < sent and time.monotonic() < deadline:
        receive(50)
    return {"sent": sent, "answered": answered, "seconds": round(time.monotonic() - start, 3)}


def in_netns_cmd(ns: str, args: list) -> list:
    """The command line running this module with args in network namespace ns."""
    return ["ip", "netns", "exec", ns, sys.executable, HERE, *args]


def start(ns: str, args: list) -> subprocess.Popen:
    """This module's serve or ask in ns, once it said ready."""
    p = subprocess.Popen(in_netns_cmd(ns, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"dnsload {args[0]} did not start: {line!r}")
    return p


def finish(p: subprocess.Popen, timeout: float = 120) -> dict:
    """An ask's figures (it was told to go), or a server stopped."""
    out, _ = p.communicate("go\n", timeout=timeout)
    return json.loads(out) if out.strip() else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("serve", "ask"))
    ap.add_argument("--port", type=int, default=53)
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=2)
    ap.add_argument("--sockets", type=int, default=8)
    ap.add_argument("--server", default="127.0.0.1")
    ap.add_argument("--tick", type=float, default=0.001, help="seconds between two bursts of queries")
    a = ap.parse_args(argv)
    if a.what == "serve":
        serve(a.port)
    else:
        print(json.dumps(ask(a.rate, a.seconds, a.sockets, a.server, a.port, a.tick)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
