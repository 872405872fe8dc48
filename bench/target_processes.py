"""What finding the capture targets' processes costs
(exporter.capture.members.processes: the processes whose files get the TLS
uprobes), per target kind, over this machine's real /proc:

  sudo .venv/bin/python bench/target_processes.py
  sudo .venv/bin/python bench/target_processes.py --spawn 2000 --netns 20   # a node's scale

--spawn N starts N sleeping processes first (a node of thousands), --netns M
M more, each in a network namespace of its own (a pod's); all are killed at
the end. Each kind is timed --rounds times; min and median are printed, and
beside them the unit costs they are made of, measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from exporter.capture import members  # noqa: E402
from exporter.capture.targets import Resolved, cgroup2_mounts, cgroup_id_level, start_time  # noqa: E402


def timed(fn, rounds: int) -> tuple:
    """(min, median) seconds of fn(), and its last result."""
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts), out


def unit_costs(rounds: int) -> list:
    """(what, us each, how many) of the reads processes() is made of."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    fds = []
    for p in pids:
        try:
            fds += [f"/proc/{p}/fd/{f}" for f in os.listdir(f"/proc/{p}/fd")]
        except OSError:
            pass

    def readlinks(paths):
        for f in paths:
            try:
                os.readlink(f)
            except OSError:
                pass
    me = os.getpid()
    rows = [("readlink /proc/PID/ns/net", lambda: [members.netns_of("/proc", p) for p in pids], len(pids)),
            ("read /proc/PID/stat (kernel thread?)", lambda: [members.is_user_process("/proc", p) for p in pids],
             len(pids)),
            ("readlink /proc/PID/fd/N", lambda: readlinks(fds), len(fds)),
            ("read net/tcp + net/tcp6 of a netns", lambda: members.tcp_socket_inodes("/proc", me, {9}), 1)]
    return [(what, timed(fn, rounds)[0] / n * 1e6, n) for what, fn, n in rows]


def spawn(n: int, netns: int) -> list:
    null = subprocess.DEVNULL
    kids = [subprocess.Popen(["sleep", "3600"], stdin=null, stdout=null) for _ in range(n)]
    kids += [subprocess.Popen(["unshare", "-n", "sleep", "3600"], stdin=null, stdout=null) for _ in range(netns)]
    time.sleep(0.5)                          # unshare has exec'd sleep in its namespace
    return kids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spawn", type=int, default=0, help="sleeping processes started first")
    ap.add_argument("--netns", type=int, default=0, help="sleeping processes, each in a netns of its own")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    kids = spawn(a.spawn, a.netns)
    try:
        me = os.getpid()
        nets = members.netns_of_all()
        nfds = sum(len(os.listdir(f"/proc/{p}/fd")) for p in nets if os.path.isdir(f"/proc/{p}/fd"))
        tcp = sum(len(open(f"/proc/self/net/{f}").readlines()) - 1 for f in ("tcp", "tcp6"))
        print(f"/proc: {len(nets)} processes, {len(set(nets.values()))} network namespaces, {nfds} fds, "
              f"{tcp} TCP sockets in this one (kernel {os.uname().release}, {os.cpu_count()} CPUs)\n")
        root = cgroup2_mounts()[0][0]
        cid, lvl = cgroup_id_level(root)
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        kinds = [("pid: this process", Resolved(pids={me}, pid_starts={me: start_time("/proc", me)})),
                 (f"cgroup: {root} (the whole tree)", Resolved(cgroups={cid: lvl}, cgroup_paths={root: cid})),
                 ("netns: this one", Resolved(netns={members.netns_of("/proc", me)})),
                 ("port: this process's listener", Resolved(ports={port})),
                 ("port: 9 (no socket has it)", Resolved(ports={9}))]
        print(f"{'target':48s} {'min ms':>8s} {'median':>8s} {'processes':>10s}")
        for label, r in kinds:
            lo, med, out = timed(lambda r=r: members.processes(r), a.rounds)
            print(f"{label:48s} {lo * 1e3:8.2f} {med * 1e3:8.2f} {len(out):10d}")
        srv.close()
        print(f"\n{'made of':48s} {'us each':>8s} {'count':>8s}")
        for what, us, n in unit_costs(a.rounds):
            print(f"{what:48s} {us:8.1f} {n:8d}")
    finally:
        for k in kids:
            k.kill()
        for k in kids:
            k.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
