"""Kernel tests of the capture targets' lifetime: a pid target whose process
exits and a cgroup target that is removed are dropped from the kernel's
filter (a process reusing the pid is not captured), and a change of targets
is one transaction within the maps' capacity."""
import os
import signal
import subprocess
import uuid

import pytest

from conftest import kernel_cgroups, streams, wait_until
from exporter.kernel import maps
from exporter.config import ConfigError
from helpers import cgroup_v2_root, move_to_cgroup, scratch_cgroup
from traffic import ClientProcess, Server, payload, send_messages


N, S = 20, 1000


def kernel_pids(run) -> set:
    return {int.from_bytes(k, "little") for k in maps.keys(run.app.probes.map_fds["capture_pids"], 4)}


def client_with_pid(pid: int, port: int) -> ClientProcess:
    """A client process that gets the number pid (ns_last_pid: the kernel
    hands out the number after it next; another fork may win the race)."""
    for _ in range(100):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        cl = ClientProcess(port, N, S)
        if cl.pid == pid:
            return cl
        cl.p.kill()
        cl.p.wait()
    pytest.fail(f"could not get pid {pid} for a new process")


# With the mechanism nettap picks (what is tested here is user space and the
# filter every mechanism shares; test_capture runs each mechanism).
def test_exited_pid_target_dropped_and_its_reused_pid_not_captured(nettap_run):
    srv = Server()
    first = ClientProcess(srv.port, N, S)
    run = nettap_run({"captures": [{"pid": first.pid}]})
    assert kernel_pids(run) == {first.pid}
    first.go()                                       # sends, exits, is reaped
    srv.wait_received(1)
    wait_until(lambda: kernel_pids(run) == set(), what="the exited pid dropped from the kernel's map")
    # counted right after the map write (the watch thread: wait, the guests are slow)
    wait_until(lambda: run.app.target_maps.gone_total["pid"] == 1, what="the exited pid counted")
    second = client_with_pid(first.pid, srv.port)    # another process, the same number
    # An unrelated edit of a config that still lists the exited pid: accepted.
    run.apply({"captures": [{"pid": first.pid}, {"port": 1}]})
    assert kernel_pids(run) == set() and run.app.target_maps.current.gone == {("pid", first.pid)}
    second.go()
    srv.wait_received(2)
    c = run.counters()
    assert c["tcp_sendmsg"]["calls"] == N and c["tcp_sendmsg"]["bytes"] == N * S
    lines, _ = run.finish()
    assert list(streams(lines, "egress").values()) == [payload(N * S)]


# With the mechanism nettap picks (what is tested here is user space and the
# filter every mechanism shares; test_capture runs each mechanism).
def test_removed_cgroup_target_dropped_and_later_edits_accepted(nettap_run):
    with scratch_cgroup() as cg:
        srv = Server()
        run = nettap_run({"captures": [{"cgroup": cg}]})
        cid = os.stat(cg).st_ino
        assert kernel_cgroups(run) == {cid}
        cl = ClientProcess(srv.port, N, S)
        move_to_cgroup(cg, cl.pid)
        cl.go()
        srv.wait_received(1)
        os.rmdir(cg)
        wait_until(lambda: kernel_cgroups(run) == set(), what="the removed cgroup dropped from the kernel's map")
        wait_until(lambda: run.app.target_maps.gone_total["cgroup"] == 1, what="the removed cgroup counted")
        run.apply({"captures": [{"cgroup": cg}, {"port": srv.port}]})        # accepted, reported
        send_messages(srv.port, N, S)
        srv.wait_received(2)
        assert run.counters()["tcp_sendmsg"]["calls"] == 2 * N


# Forks n children that wait, prints their pids, waits too: a shell's
# subshells each blocked in `read` on the spawner's stdin (held open by the
# test) cost far less than n execs of sleep(1) (~80 s in the matrix's guests)
# and than a Python forking itself (~3x this here).
SPAWN = r"""
exec 3<&0
i=0 pids=
while [ "$i" -lt "$1" ]; do read -r _ <&3 & pids="$pids $!"; i=$((i + 1)); done
echo $pids
wait
"""


def test_over_capacity_refused_and_a_failed_apply_rolls_back(nettap_run):
    """1,100 pids against 1,024-entry maps: refused up front, naming the
    limit read from the map; where the kernel refuses a write midway anyway,
    the maps are restored exactly, and the next config leaves nothing of it."""
    spawner = subprocess.Popen(["/bin/sh", "-c", SPAWN, "sh", "1100"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in spawner.stdout.readline().split()]
        assert len(pids) == 1100
        keep = pids[0]
        run = nettap_run({"captures": [{"pid": keep}, {"port": 1}]})
        cap = run.app.probes.map_info["capture_pids"][3]
        assert cap < 1100
        many = {"captures": [{"pid": p} for p in pids]}
        with pytest.raises(ConfigError, match=rf"^captures: 1100 pid targets, more than the {cap} the kernel "
                                              r"map capture_pids holds"):
            run.apply(many)
        assert kernel_pids(run) == {keep}
        run.app.target_maps.capacity = {}            # let it through: the kernel refuses entry cap + 1
        with pytest.raises(OSError):
            run.apply(many)
        assert kernel_pids(run) == {keep} and run.app.target_maps.current.pids == {keep}
        run.apply({"captures": [{"pid": pids[1]}]})
        assert kernel_pids(run) == {pids[1]}
    finally:
        os.killpg(spawner.pid, signal.SIGKILL)       # the spawner and its children
        spawner.wait()


def test_cgroup_target_from_inside_a_private_cgroup_namespace(tmp_path):
    """nettap started, as in a Kubernetes pod, inside a cgroup (level 1) and
    a cgroup namespace rooted there: the v2 mount's root shows as "/..". A
    cgroup target (level 1 of the whole hierarchy) must still be matched."""
    from procs import Nettap
    root = cgroup_v2_root()
    tag = uuid.uuid4().hex[:8]
    home, target = os.path.join(root, f"nettap-ns-{tag}"), os.path.join(root, f"nettap-target-{tag}")
    os.mkdir(home)
    os.mkdir(target)
    n = None
    try:
        srv = Server()
        n = Nettap(tmp_path, {"captures": [{"cgroup": target}], "output": {"type": "none"}},
                   cgroups=[home], wrap=["unshare", "--cgroup", "--"])
        assert os.stat(f"/proc/{n.p.pid}/ns/cgroup").st_ino != os.stat("/proc/self/ns/cgroup").st_ino
        cl = ClientProcess(srv.port, N, S)
        move_to_cgroup(target, cl.pid)
        cl.go()
        send_messages(srv.port, N, S)                # outside the target cgroup
        srv.wait_received(2)
        assert n.sample("nettap_probe_calls_total", probe="tcp_sendmsg") == N
        assert n.sample("nettap_probe_bytes_processed_total", probe="tcp_sendmsg") == N * S
    finally:
        if n:
            n.stop()
        for d in (target, home):
            os.rmdir(d)
