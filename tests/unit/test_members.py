"""exporter.capture.members.processes: the processes the capture targets
name, against fake /proc and cgroup v2 trees laid out as the kernel and the
kubelet lay them, and against this machine's own /proc."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from exporter.capture import members
from exporter.capture.members import PF_KTHREAD, processes
from exporter.capture.targets import Resolved, start_time

NET_A, NET_B = 4026531840, 4026532301          # network namespace inodes
POD = ("sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
       "kubepods-burstable-pod6f1c3e9a_8b2d_4c1e_9f0a_2b7d5e4c1a90.slice")
APP = "cri-containerd-3c0b2f7e51d94a6b8e2f10d7c4a9b6e5f3d2c1b0a9e8f7d6c5b4a3f2e1d0c9b8.scope"
PAUSE = "cri-containerd-9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b.scope"


def tcp_line(i: int, local: str, remote: str, inode: int, st: str = "01") -> str:
    return (f"{i:4d}: {local} {remote} {st} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 "
            "0000000000000000 20 4 30 10 -1\n")


TCP_HEAD = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
            "inode\n")
TCP6_HEAD = ("  sl  local_address                         remote_address                        st tx_queue "
             "rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


class FakeProc:
    """A /proc with processes: stat (flags, start time), status (Tgid),
    ns/net -> net:[N], fd/N -> socket:[N] or a file, net/tcp and tcp6 (the
    tables of its network namespace, set in tables before it is added:
    netns -> (tcp lines, tcp6 lines or None without IPv6))."""

    def __init__(self, root):
        self.root = root
        self.tables = {}
        root.mkdir()

    def add(self, pid, netns=NET_A, start=1000, sockets=(), kthread=False, tgid=None):
        d = self.root / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "fd").mkdir()
        flags = 0x400140 | (PF_KTHREAD if kthread else 0)
        fields = ["S", "1", str(pid), str(pid), "0", "-1", str(flags)] + ["0"] * 12 + [str(start)] + ["0"] * 30
        (d / "stat").write_text(f"{pid} (a (b) c) " + " ".join(fields) + "\n")
        (d / "status").write_text(f"Name:\tx\nTgid:\t{tgid or pid}\nPid:\t{pid}\n")
        (d / "ns" / "net").symlink_to(f"net:[{netns}]")
        (d / "fd" / "0").symlink_to("/dev/null")
        for n, inode in enumerate(sockets, 3):
            (d / "fd" / str(n)).symlink_to(f"socket:[{inode}]")
        if not kthread:
            tcp, tcp6 = self.tables.get(netns, ((), None))
            (d / "net").mkdir()
            (d / "net" / "tcp").write_text(TCP_HEAD + "".join(tcp or ()))
            if tcp6 is not None:
                (d / "net" / "tcp6").write_text(TCP6_HEAD + "".join(tcp6))
        return pid


def cgroup(root, rel: str, procs=(), kind: str | None = None):
    d = root.joinpath(*rel.split("/"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    if kind:
        (d / "cgroup.type").write_text(kind + "\n")
    return d


def cgroup_target(root, rel: str, level: int) -> Resolved:
    """As resolve() makes a cgroup target: the config's path -> its id."""
    ino = root.joinpath(*rel.split("/")).stat().st_ino
    return Resolved(cgroups={ino: level}, cgroup_paths={"/" + rel: ino})


@pytest.fixture
def proc(tmp_path):
    return FakeProc(tmp_path / "proc")


def test_pid_targets_alive_and_the_same_process(proc):
    proc.add(100, start=5000)
    proc.add(200, start=7000)          # the pid was reused: another start time
    proc.add(300, kthread=True)
    r = Resolved(pids={100, 200, 300, 400}, pid_starts={100: 5000, 200: 6000, 300: 1000, 400: 1000})
    assert processes(r, str(proc.root)) == {100}


def test_cgroup_target_a_pod_and_every_container_below(proc, tmp_path):
    cg = tmp_path / "cg"
    for pid in (11, 12, 13, 21, 31):
        proc.add(pid)
    cgroup(cg, "sys/fs/cgroup", procs=(1, 2))
    cgroup(cg, "sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice", kind="domain")
    cgroup(cg, POD, kind="domain")
    cgroup(cg, f"{POD}/{APP}", procs=(11, 12, 13), kind="domain")
    cgroup(cg, f"{POD}/{PAUSE}", procs=(21,), kind="domain")
    other = ("sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
             "kubepods-burstable-pod11111111_2222_3333_4444_555555555555.slice")
    cgroup(cg, f"{other}/{APP}", procs=(31,))
    root = str(cg)
    assert processes(cgroup_target(cg, POD, 4), str(proc.root), root) == {11, 12, 13, 21}
    assert processes(cgroup_target(cg, f"{POD}/{APP}", 5), str(proc.root), root) == {11, 12, 13}
    # the kubepods slice: both pods
    assert processes(cgroup_target(cg, "sys/fs/cgroup/kubepods.slice", 1), str(proc.root), root) == \
        {11, 12, 13, 21, 31}


def test_cgroup_target_threaded_reads_its_threads(proc, tmp_path):
    """cgroup.procs is refused in a threaded cgroup: its threads, mapped to
    their processes."""
    cg = tmp_path / "cg"
    proc.add(40)
    proc.add(41, tgid=40)              # a thread of 40 (its own /proc/TID entry)
    proc.add(50)
    cgroup(cg, "sys/fs/cgroup/app.slice", procs=(40,), kind="domain threaded")
    t = cgroup(cg, "sys/fs/cgroup/app.slice/workers", kind="threaded")
    (t / "cgroup.procs").unlink()
    (t / "cgroup.threads").write_text("41\n")
    cgroup(cg, "sys/fs/cgroup/other.slice", procs=(50,))
    assert processes(cgroup_target(cg, "sys/fs/cgroup/app.slice/workers", 3), str(proc.root), str(cg)) == {40}


def test_cgroup_target_removed_or_recreated_names_no_process(proc, tmp_path):
    cg = tmp_path / "cg"
    proc.add(11)
    cgroup(cg, f"{POD}/{APP}", procs=(11,))
    r = cgroup_target(cg, POD, 4)
    recreated = Resolved(cgroups=r.cgroups, cgroup_paths={p: i + 1 for p, i in r.cgroup_paths.items()})
    assert processes(recreated, str(proc.root), str(cg)) == set()
    assert processes(r, str(proc.root), str(tmp_path / "elsewhere")) == set()


def test_netns_target(proc):
    proc.add(10, netns=NET_A)
    proc.add(20, netns=NET_B)
    proc.add(21, netns=NET_B)
    proc.add(2, netns=NET_B, kthread=True)
    assert processes(Resolved(netns={NET_B}), str(proc.root)) == {20, 21}
    assert processes(Resolved(netns={NET_A, NET_B}), str(proc.root)) == {10, 20, 21}
    assert processes(Resolved(netns={123}), str(proc.root)) == set()


def test_port_target_local_or_remote_port_in_each_netns(proc):
    """The filter compares the socket's local port (skc_num) and its remote
    port (skc_dport): a server's listener and accepted sockets, a client's
    connection to it; each namespace's own tables."""
    ns_a = [tcp_line(0, "00000000:01BB", "00000000:0000", 501, "0A"),     # *:443 listening
            tcp_line(1, "0100007F:01BB", "0100007F:D431", 502),           # accepted from :54321
            tcp_line(2, "0100007F:D431", "0100007F:01BB", 503),           # the client's end
            tcp_line(3, "0100007F:1F90", "0100007F:9C40", 504),           # :8080, not a target
            tcp_line(4, "0100007F:01BB", "0100007F:D432", 0, "06")]       # TIME_WAIT: no inode
    ns_b = [tcp_line(0, "0A000005:8F3C", "0A000009:01BB", 601)]           # a client of :443 in B
    six = ["   0: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:A000 01 "
           "00000000:00000000 00:00000000 00000000     0        0 701 1 0000000000000000 20 4 30 10 -1\n"]
    proc.tables = {NET_A: (ns_a, six), NET_B: (ns_b, None)}           # B: no tcp6 (IPv6 off)
    proc.add(10, sockets=(501, 502))              # the server
    proc.add(11, sockets=(503,))                  # the client
    proc.add(12, sockets=(504, 701))              # :8080 only
    proc.add(20, netns=NET_B, sockets=(601,))
    proc.add(21, netns=NET_B)                     # no socket
    assert processes(Resolved(ports={443}), str(proc.root)) == {10, 11, 20}
    assert processes(Resolved(ports={8080}), str(proc.root)) == {12}
    assert processes(Resolved(ports={40960}), str(proc.root)) == {12}    # tcp6's remote port
    assert processes(Resolved(ports={54321}), str(proc.root)) == {10, 11}
    assert processes(Resolved(ports={9}), str(proc.root)) == set()


def test_a_mix_of_every_kind(proc, tmp_path):
    cg = tmp_path / "cg"
    proc.tables = {NET_A: ([tcp_line(0, "0100007F:0050", "0100007F:C000", 900)], [])}
    proc.add(10, start=77)
    proc.add(11)
    proc.add(20, netns=NET_B)
    proc.add(30, sockets=(900,))
    proc.add(40)
    cgroup(cg, f"{POD}/{APP}", procs=(11,))
    r = cgroup_target(cg, POD, 4)
    r = Resolved(pids={10}, pid_starts={10: 77}, cgroups=r.cgroups, cgroup_paths=r.cgroup_paths,
                 netns={NET_B}, ports={80})
    assert processes(r, str(proc.root), str(cg)) == {10, 11, 20, 30}


def test_processes_that_vanish_mid_walk(proc, tmp_path):
    """Listed somewhere, gone from /proc (or half gone): left out, no error."""
    cg = tmp_path / "cg"
    proc.tables = {NET_A: ([tcp_line(0, "0100007F:0050", "0100007F:C000", 900)], [])}
    proc.add(10, sockets=(900,))
    proc.add(5)                                   # its net/ went first: the next process reads the tables
    (proc.root / "5" / "net" / "tcp").unlink()
    proc.add(6)                                   # its stat went last
    (proc.root / "6" / "stat").unlink()
    proc.add(7, sockets=(900,))                   # its fd/ went
    for f in (proc.root / "7" / "fd").iterdir():
        f.unlink()
    (proc.root / "7" / "fd").rmdir()
    (proc.root / "8").mkdir()                     # only its directory left
    cgroup(cg, f"{POD}/{APP}", procs=(6, 10, 99))  # 99: no /proc entry
    r = cgroup_target(cg, POD, 4)
    assert processes(r, str(proc.root), str(cg)) == {10}
    assert processes(Resolved(ports={80}), str(proc.root)) == {10}
    assert processes(Resolved(netns={NET_A}), str(proc.root)) == {5, 7, 10}


def test_links_in_a_cgroup_tree_are_not_followed(proc, tmp_path):
    cg = tmp_path / "cg"
    proc.add(11)
    proc.add(66)
    cgroup(cg, "sys/fs/cgroup/elsewhere", procs=(66,))
    d = cgroup(cg, f"{POD}/{APP}", procs=(11,))
    (d / "link").symlink_to(cg / "sys" / "fs" / "cgroup" / "elsewhere")
    other = cgroup(cg, f"{POD}/{PAUSE}")
    (other / "cgroup.procs").unlink()
    (other / "cgroup.procs").symlink_to(cg / "sys" / "fs" / "cgroup" / "elsewhere" / "cgroup.procs")
    assert processes(cgroup_target(cg, POD, 4), str(proc.root), str(cg)) == {11}


# ---- this machine's /proc -------------------------------------------------------

def test_real_proc_each_kind_finds_this_process():
    me = os.getpid()
    assert processes(Resolved(pids={me}, pid_starts={me: start_time("/proc", me)})) == {me}
    ns = os.stat("/proc/self/ns/net").st_ino
    assert members.netns_of("/proc", me) == ns
    assert me in processes(Resolved(netns={ns}))
    assert not {p for p in processes(Resolved(netns={ns})) if not members.is_user_process("/proc", p)}
    assert 2 not in processes(Resolved(netns={ns}))            # kthreadd
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert processes(Resolved(ports={port})) == {me}
        # a child holding the client's end: a connection whose remote port is the target
        with socket.create_connection(("127.0.0.1", port)) as cli:
            child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                     stdin=subprocess.PIPE, pass_fds=(cli.fileno(),))
        bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            found = processes(Resolved(ports={port}))
            assert child.pid in found and me in found and bystander.pid not in found
            assert {child.pid, bystander.pid} <= processes(Resolved(netns={ns}))
        finally:
            for p in (child, bystander):
                p.stdin.close()
                p.wait(10)
