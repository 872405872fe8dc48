"""Helpers more than one test module (or a benchmark) needs: stopping a
child process, the host's cgroup v2 root and a scratch cgroup under it,
tshark's reading of a pcap stream, threads started together. Only the
standard library and exporter.util, so bench/ imports it too (tests/ on
sys.path, as conftest.py puts it)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import uuid
from typing import Callable, Iterator


def stop(p: subprocess.Popen, log=None, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Stop p if it still runs (sig, then SIGKILL after timeout s), close
    its log file if given; its exit status."""
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if log is not None:
        log.close()
    return p.returncode


def cgroup_v2_root() -> str:
    """Where this process sees the cgroup v2 hierarchy mounted; AssertionError without one."""
    from exporter.util import mounts
    for m in mounts.read():
        if m.fstype == "cgroup2":
            return m.mountpoint
    raise AssertionError("no cgroup v2 hierarchy mounted")


@contextlib.contextmanager
def scratch_cgroup(prefix: str = "nettap-test") -> Iterator[str]:
    """A new cgroup directory under the v2 root, removed after (if the test
    has not: empty by then)."""
    cg = os.path.join(cgroup_v2_root(), f"{prefix}-{uuid.uuid4().hex[:8]}")
    os.mkdir(cg)
    try:
        yield cg
    finally:
        if os.path.isdir(cg):
            os.rmdir(cg)


def move_to_cgroup(cg: str, pid: int) -> None:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def tshark_follow(pcap, stream: int, timeout: float = 60) -> dict:
    """tshark's "Follow TCP stream" (raw) of one stream of a pcap file:
    {node number: (address, bytes it sent)}."""
    p = subprocess.run(["tshark", "-r", str(pcap), "-q", "-z", f"follow,tcp,raw,{stream}"],
                       capture_output=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    nodes, data = {}, {0: b"", 1: b""}
    for line in p.stdout.decode().splitlines():
        if line.startswith("Node "):
            n, addr = line[5:].split(": ", 1)
            nodes[int(n)] = addr
        elif nodes and line and not line.startswith("="):
            data[1 if line.startswith("\t") else 0] += bytes.fromhex(line.strip())
    return {n: (nodes[n], data[n]) for n in nodes}


def together(n: int, body: Callable[[int], list]) -> list:
    """Run body(0) .. body(n - 1) in n threads released at once (a barrier);
    once all have ended, the lists they returned, joined (e.g. the wrong
    answers each saw)."""
    start, out = threading.Barrier(n), []

    def run(i):
        start.wait()
        out.extend(body(i))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
