"""Shared by the benchmarks that run nettap as its own process (the real
CLI, as root): start it with a config, read its /metrics, its CPU and peak
RSS from /proc, and build the benchmarks' small C programs into bench/out/."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
OUT = os.path.join(BENCH, "out")
TICK = os.sysconf("SC_CLK_TCK")
RINGS = ("capture_chunks", "capture_eof", "logs")

sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers import stop  # noqa: E402,F401  (the benchmarks' _nettap.stop: SIGTERM, SIGKILL after 30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(name: str) -> str:
    """bench/NAME.c compiled with `cc -O2` into bench/out/NAME (when the
    source is newer than the binary); returns the binary's path."""
    src, exe = os.path.join(BENCH, name + ".c"), os.path.join(OUT, name)
    os.makedirs(OUT, exist_ok=True)
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["cc", "-O2", "-Wall", "-pthread", "-o", exe, src], check=True)
    return exe


def nettap_cmd() -> list:
    exe = os.path.join(ROOT, ".venv", "bin", "nettap")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "exporter"]


def start_nettap(cfg: str, mport: int, log=None, extra=(), auth=None) -> subprocess.Popen:
    """nettap --config cfg on 127.0.0.1:mport (and extra arguments), returned
    once /readyz says 200 (asked with the Authorization header auth, if given)."""
    p = subprocess.Popen(nettap_cmd() + ["--config", cfg, "--web.listen-address", f"127.0.0.1:{mport}",
                                         "--log.level", "warning", *extra], cwd=ROOT, stderr=log)
    deadline = time.time() + 30
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"nettap exited with {p.returncode} before it was ready")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{mport}/readyz",
                                         headers={"Authorization": auth} if auth else {})
            if urllib.request.urlopen(req, timeout=1).status == 200:
                return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit("nettap did not become ready in 30 s")


def start_ingest(cfg: str, mport: int, extra=()) -> subprocess.Popen:
    """nettap ingest --config cfg on 127.0.0.1:mport (and extra arguments),
    returned once it is connected to its engine (nettap_ingest_connected 1)."""
    p = subprocess.Popen(nettap_cmd() + ["ingest", "--config", cfg, "--web.listen-address", f"127.0.0.1:{mport}",
                                         "--log.level", "warning", *extra], cwd=ROOT)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if metrics(mport).get("nettap_ingest_connected") == 1:
                return p
        except OSError:
            time.sleep(0.05)
            continue
        time.sleep(0.05)
    stop(p)
    raise SystemExit("nettap ingest did not connect to its engine in 30 s")


_LINE = re.compile(r'^(nettap_\w+)(\{[^}]*\})? (\S+)$')


def metrics(port: int) -> dict:
    """nettap_* samples of /metrics: {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def label_values(m: dict, name: str) -> dict:
    """{label value: sample} of a one-label metric family."""
    out = {}
    for k, v in m.items():
        if k.startswith(name + "{"):
            out[k.split('"')[1]] = v
    return out


def family_sum(m: dict, name: str) -> float:
    """The sum of a metric family's samples (labelled or not)."""
    return sum(label_values(m, name).values()) + m.get(name, 0.0)


def _stat(pid: int) -> list:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def tree(pid: int) -> list:
    """pid and its live descendants (nettap may run helpers in child processes)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                kids.setdefault(int(_stat(int(d))[1]), []).append(int(d))
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_s(pid: int, children: bool = True) -> float:
    """utime + stime, seconds, of a process and (children=True) of its live
    descendants and of the children it has reaped."""
    total = 0.0
    for p in (tree(pid) if children else [pid]):
        try:
            f = _stat(p)
        except OSError:
            continue
        total += int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if children else 0)
    return total / TICK


def thread_cpu_s(pid: int) -> dict:
    """utime + stime, seconds, of each thread of a process, by thread name
    (nettap names its drain and sink threads: nettap-drain, nettap-sink)."""
    out: dict = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        name = comm.split("(", 1)[1]
        f = rest.split()
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / TICK
    return out


def status_mb(pid: int, field: str = "VmHWM", children: bool = True) -> float:
    """A /proc/PID/status size in MB, summed over the process's live descendants."""
    total = 0
    for p in (tree(pid) if children else [pid]):
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024
