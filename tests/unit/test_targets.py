"""exporter.capture.targets and filter without root or BPF: resolve() against this process, temp
directories with fake mountinfo files, and TargetMaps.apply with the map
writes recorded instead of made."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import shutil
import struct

import pytest

from exporter.kernel import maps, tcp_h
from exporter.capture import filter as capture_filter
from exporter.capture import targets
from exporter.capture.filter import TargetMaps, wakeup_check_bytes
from exporter.capture.targets import (MAX_CGROUP_LEVEL, TARGET_CGROUP, TARGET_NETNS, TARGET_PID, TARGET_PORT,
                                      Resolved, cgroup2_mounts, cgroup_id_level, netns_inode, resolve)
from exporter.config import ConfigError, Target
from exporter.metrics.targets import TargetsCollector

MISSING_PID = 2**22 - 1          # the largest pid config accepts; no process has it here


def mountinfo(tmp_path: Path, *mounts) -> str:
    """A mountinfo file: the usual root and proc lines plus, per (fstype,
    mount point, root), one line. Mount points are escaped as the kernel does."""
    def esc(s):
        return (s.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
                .replace("\n", "\\012"))
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
             "23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw"]
    for i, (fstype, mnt, root) in enumerate(mounts):
        opts = "rw,nosuid,nodev,noexec,relatime shared:%d" % (40 + i)
        lines.append(f"{30 + i} 22 0:{30 + i} {esc(root)} {esc(str(mnt))} {opts} - {fstype} {fstype} rw")
    p = tmp_path / "mountinfo"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


@pytest.fixture
def cg(tmp_path):
    """A directory standing in for a cgroup2 mount, with a/b below it."""
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    return root


# ---- resolve: ports and pids ---------------------------------------------------

def test_ports_and_pid():
    r = resolve([Target("port", 80), Target("port", 443), Target("port", 80), Target("pid", os.getpid())])
    assert r.ports == {80, 443} and r.pids == {os.getpid()}
    assert r.cgroups == {} and r.netns == set()


def test_missing_pid_names_the_item():
    if os.path.exists(f"/proc/{MISSING_PID}"):
        pytest.skip("a process has the largest pid")
    with pytest.raises(ConfigError) as e:
        resolve([Target("port", 80), Target("pid", MISSING_PID)])
    assert str(e.value).startswith("captures[1].pid: ")
    assert str(MISSING_PID) in str(e.value) and "no such process" in str(e.value)


def fake_proc(tmp_path, start=5000, **tgids):
    """A /proc with <pid>/status and <pid>/stat files: tgids = {"p123": 123,
    "p124": 123}; every process started at clock tick start."""
    for name, tgid in tgids.items():
        d = tmp_path / name[1:]
        d.mkdir(exist_ok=True)
        (d / "status").write_text(f"Name:\tx\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{tgid}\n"
                                  f"Ngid:\t0\nPid:\t{name[1:]}\n")
        set_start(tmp_path, int(name[1:]), start)
    return str(tmp_path)


def set_start(proc, pid, start, comm="a) b (c"):
    """/proc/PID/stat with the given start time (field 22); the command name
    holds spaces and parentheses, as a process may name itself."""
    fields = ["S", "1", str(pid), str(pid)] + ["0"] * 15 + [str(start)] + ["0"] * 30
    (Path(proc) / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def test_pid_checked_under_the_given_proc(tmp_path):
    proc = fake_proc(tmp_path, p123=123, p124=123)       # 124 is a thread of 123
    assert resolve([Target("pid", 123)], proc=proc).pids == {123}
    with pytest.raises(ConfigError, match=r"captures\[0\]\.pid: pid 124"):
        resolve([Target("pid", 124)], proc=proc)
    with pytest.raises(ConfigError, match=r"captures\[0\]\.pid: pid 125"):
        resolve([Target("pid", 125)], proc=proc)


def test_thread_id_is_not_a_pid():
    got, done = [], threading.Event()

    def run():
        got.append(threading.get_native_id())
        done.wait(5)

    t = threading.Thread(target=run)
    t.start()
    try:
        while not got:
            pass
        tid = got[0]
        assert tid != os.getpid() and os.path.exists(f"/proc/{tid}")
        with pytest.raises(ConfigError, match=rf"captures\[0\]\.pid: pid {tid}: .*thread"):
            resolve([Target("pid", tid)])
    finally:
        done.set()
        t.join()


def test_empty():
    r = resolve([])
    assert r == Resolved() and r.flags == 0 and r.cgroup_levels == 0


# ---- cgroups ---------------------------------------------------------------

def test_cgroup_missing_path():
    with pytest.raises(ConfigError) as e:
        resolve([Target("port", 1), Target("cgroup", "/sys/fs/cgroup/no/such/nettap-test")])
    assert str(e.value).startswith("captures[1].cgroup: ")
    assert "no such cgroup directory" in str(e.value)


def test_cgroup_file_is_not_a_cgroup(tmp_path, cg):
    f = cg / "cgroup.procs"
    f.write_text("")
    with pytest.raises(ConfigError, match="no such cgroup directory"):
        cgroup_id_level(str(f), mountinfo(tmp_path, ("cgroup2", cg, "/")))


def test_cgroup_not_on_cgroup2(tmp_path, cg):
    other = tmp_path / "elsewhere"
    other.mkdir()
    mi = mountinfo(tmp_path, ("cgroup2", other, "/"), ("cgroup", cg, "/"))   # cg is v1 here
    with pytest.raises(ConfigError, match="not on a cgroup v2 hierarchy"):
        cgroup_id_level(str(cg / "a"), mi)


def test_cgroup_not_on_cgroup2_through_resolve(tmp_path, cg, monkeypatch):
    mi = mountinfo(tmp_path, ("cgroup2", tmp_path / "elsewhere", "/"))
    real = targets.cgroup2_mounts
    monkeypatch.setattr(targets, "cgroup2_mounts", lambda _=None: real(mi))
    with pytest.raises(ConfigError) as e:
        resolve([Target("cgroup", str(cg / "a"))])
    assert str(e.value).startswith("captures[0].cgroup: cgroup ")
    assert "not on a cgroup v2 hierarchy" in str(e.value)


def test_cgroup_prefix_is_not_a_mount(tmp_path):
    """A mount at .../cg does not cover .../cg2."""
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg2" / "x").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not on a cgroup v2 hierarchy"):
        cgroup_id_level(str(tmp_path / "cg2" / "x"), mountinfo(tmp_path, ("cgroup2", tmp_path / "cg", "/")))


def test_cgroup_levels(tmp_path, cg):
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    assert cgroup_id_level(str(cg), mi) == (os.stat(cg).st_ino, 0)
    assert cgroup_id_level(str(cg / "a"), mi) == (os.stat(cg / "a").st_ino, 1)
    assert cgroup_id_level(str(cg / "a" / "b"), mi) == (os.stat(cg / "a" / "b").st_ino, 2)
    assert cgroup_id_level(str(cg / "a" / "b") + "/", mi)[1] == 2
    assert cgroup_id_level(str(cg / "a" / ".." / "a" / "b"), mi)[1] == 2


def test_cgroup_level_with_mount_root(tmp_path, cg):
    """A container's cgroup2 mount shows only its subtree: the root field
    counts toward the level."""
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/kubepods"))
    assert cgroup_id_level(str(cg / "a" / "b"), mi)[1] == 3
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/kubepods/burstable/pod1"))
    assert cgroup_id_level(str(cg), mi)[1] == 3


def test_cgroup_symlink_resolves_to_target(tmp_path, cg):
    link = tmp_path / "link"
    link.symlink_to(cg / "a")
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    assert cgroup_id_level(str(link / "b"), mi) == (os.stat(cg / "a" / "b").st_ino, 2)


def test_cgroup_longest_mount_wins(tmp_path, cg):
    """The same hierarchy mounted twice (e.g. a bind of a subtree): the most
    specific mount decides, and both give the same level."""
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"), ("cgroup2", cg / "a", "/a"))
    assert cgroup_id_level(str(cg / "a" / "b"), mi)[1] == 2
    mi = mountinfo(tmp_path, ("cgroup2", cg / "a", "/a"), ("cgroup2", cg, "/"))   # order does not matter
    assert cgroup_id_level(str(cg / "a" / "b"), mi)[1] == 2


def test_cgroup_mount_point_with_space(tmp_path):
    cg = tmp_path / "my cg"
    (cg / "x").mkdir(parents=True)
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    assert cgroup2_mounts(mi)[-1] == (str(cg), "/")
    assert cgroup_id_level(str(cg / "x"), mi)[1] == 1


def test_cgroup_mount_point_with_backslash(tmp_path):
    cg = tmp_path / "cg\\x"
    (cg / "x").mkdir(parents=True)
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    assert cgroup_id_level(str(cg / "x"), mi)[1] == 1


def test_cgroup_too_deep(tmp_path, cg):
    root = "/" + "/".join(f"l{i}" for i in range(MAX_CGROUP_LEVEL - 1))   # level of cg = 30
    mi = mountinfo(tmp_path, ("cgroup2", cg, root))
    assert cgroup_id_level(str(cg / "a"), mi)[1] == MAX_CGROUP_LEVEL
    with pytest.raises(ConfigError, match=f"level {MAX_CGROUP_LEVEL + 1} is deeper than {MAX_CGROUP_LEVEL}"):
        cgroup_id_level(str(cg / "a" / "b"), mi)


def test_cgroup2_mounts_parses_only_cgroup2(tmp_path, cg):
    mi = mountinfo(tmp_path, ("cgroup", tmp_path / "v1", "/"), ("cgroup2", cg, "/sub"),
                   ("tmpfs", tmp_path / "t", "/"))
    assert cgroup2_mounts(mi) == [(str(cg), "/sub")]


def test_cgroup_resolve_uses_real_mountinfo():
    """The running system's own cgroup2 mount, if there is one, resolves."""
    mounts = cgroup2_mounts()
    if not mounts:
        pytest.skip("no cgroup2 mount on this system")
    mnt, root = mounts[0]
    if not os.path.isdir(mnt):
        pytest.skip("cgroup2 mount point not visible")
    r = resolve([Target("cgroup", mnt)])
    assert r.cgroups == {os.stat(mnt).st_ino: len([p for p in root.split("/") if p])}


# ---- netns ----------------------------------------------------------------

def test_netns_missing():
    with pytest.raises(ConfigError) as e:
        resolve([Target("netns", "/var/run/netns/no-such-nettap-test")])
    assert str(e.value).startswith("captures[0].netns: netns /var/run/netns/no-such-nettap-test: ")
    assert "No such file or directory" in str(e.value)


def test_netns_regular_file(tmp_path):
    f = tmp_path / "ns"
    f.write_text("")
    with pytest.raises(ConfigError, match="not a namespace file"):
        resolve([Target("netns", str(f))])


def test_netns_own():
    ino = os.stat("/proc/self/ns/net").st_ino
    assert netns_inode("/proc/self/ns/net") == ino
    r = resolve([Target("netns", "/proc/self/ns/net"), Target("netns", f"/proc/{os.getpid()}/ns/net")])
    assert r.netns == {ino}


def fake_netns_proc(tmp_path, pids=None, nsfs_mounts=()):
    """A /proc whose <pid>/ns/net links name namespaces (pids = {pid: inode})
    and whose self/mountinfo has an nsfs bind mount per inode in nsfs_mounts."""
    proc = tmp_path / "proc"
    for pid, ino in (pids or {}).items():
        (proc / str(pid) / "ns").mkdir(parents=True)
        (proc / str(pid) / "ns" / "net").symlink_to(f"net:[{ino}]")
    (proc / "self").mkdir(parents=True)
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"]
    lines += [f"{600 + i} 30 0:4 net:[{ino}] /run/netns/ns{i} rw shared:{700 + i} - nsfs nsfs rw"
              for i, ino in enumerate(nsfs_mounts)]
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(proc)


def test_netns_integer_held_by_a_process(tmp_path):
    proc = fake_netns_proc(tmp_path, {1: 4026531840, 77: 4026532001})
    assert netns_inode(4026532001, proc) == 4026532001
    assert resolve([Target("netns", 4026531840)], proc=proc).netns == {4026531840}


def test_netns_integer_held_by_a_bind_mount(tmp_path):
    proc = fake_netns_proc(tmp_path, {1: 4026531840}, nsfs_mounts=[4026532777])
    assert resolve([Target("netns", 4026532777)], proc=proc).netns == {4026532777}


def test_netns_integer_that_nothing_has_is_refused(tmp_path):
    # Was taken as is: a typo captured nothing, silently.
    proc = fake_netns_proc(tmp_path, {1: 4026531840}, nsfs_mounts=[4026532777])
    with pytest.raises(ConfigError) as e:
        resolve([Target("port", 80), Target("netns", 4026532778)], proc=proc)
    assert str(e.value) == (f"captures[1].netns: netns 4026532778: no such network namespace (no process in "
                            f"{proc} and no nsfs bind mount, e.g. under /run/netns, has it)")


def test_netns_integer_own_namespace_on_this_host():
    ino = os.stat("/proc/self/ns/net").st_ino
    assert resolve([Target("netns", ino)]).netns == {ino}


def test_netns_other_namespace_type_refused():
    with pytest.raises(ConfigError, match="not a network namespace"):
        netns_inode("/proc/self/ns/mnt")
    with pytest.raises(ConfigError, match=r"captures\[0\]\.netns: .*not a network namespace"):
        resolve([Target("netns", "/proc/self/ns/uts")])


def test_netns_directory_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a namespace file"):
        netns_inode(str(tmp_path))


def test_netns_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = []

    def run():
        try:
            netns_inode(str(fifo))
        except ConfigError as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(2)
    hung = t.is_alive()
    if hung:                                   # unblock the open so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        t.join(2)
        os.close(fd)
    assert not hung, "netns_inode blocked on a FIFO"
    assert result and "not a namespace file" in str(result[0])


# ---- Resolved -------------------------------------------------------------

def test_flags():
    assert Resolved().flags == 0
    assert Resolved(pids={1}).flags == TARGET_PID
    assert Resolved(cgroups={9: 1}).flags == TARGET_CGROUP
    assert Resolved(netns={5}).flags == TARGET_NETNS
    assert Resolved(ports={80}).flags == TARGET_PORT
    assert Resolved(pids={1}, cgroups={9: 1}, netns={5}, ports={80}).flags == 15
    assert (TARGET_PID, TARGET_CGROUP, TARGET_NETNS, TARGET_PORT) == (1, 2, 4, 8)


def test_cgroup_levels_bits():
    assert Resolved(cgroups={5: 2, 6: 3, 7: 2}).cgroup_levels == 0b1100
    assert Resolved(cgroups={1: 0}).cgroup_levels == 1
    assert Resolved(cgroups={1: MAX_CGROUP_LEVEL}).cgroup_levels == 1 << 31
    assert Resolved(cgroups={1: MAX_CGROUP_LEVEL}).cgroup_levels <= 0xFFFFFFFF   # fits the u32


# ---- TargetMaps.apply: order of the writes ------------------------------------

FDS = {"capture_pids": 11, "capture_cgroups": 12, "capture_netns": 13, "capture_ports": 14,
       "capture_config": 15, "capture_pid_bits": 16, "capture_port_kinds": 17}
SEG = 1 << tcp_h.KIND_SEGMENT          # a target entry's bit for segment records
NAMES = {v: k for k, v in FDS.items()}


@pytest.fixture
def calls(monkeypatch):
    log = []
    monkeypatch.setattr(maps, "update", lambda fd, key, value, flags=0: log.append(("update", NAMES[fd], key, value)))
    monkeypatch.setattr(maps, "delete", lambda fd, key: log.append(("delete", NAMES[fd], key)))
    return log


def u32(v):
    return v.to_bytes(4, "little")


def u64(v):
    return v.to_bytes(8, "little")


WAKE = {"capture_chunks": 1024, "capture_eof": 256, "obs_events": 128}


def test_wakeup_thresholds_are_a_quarter_of_each_ring():
    assert capture_filter.wakeup_thresholds({"capture_chunks": 8 << 20, "capture_eof": 2 << 20, "logs": 64 << 10,
                                             "obs_events": 1 << 20}) == {
        "capture_chunks": 2 << 20, "capture_eof": 512 << 10, "obs_events": 256 << 10}


def config_index(log):
    idx = [i for i, c in enumerate(log) if c[1] == "capture_config"]
    assert len(idx) == 1, log
    return idx[0]


def decode_config(value):
    """struct nettap_capture_config (bpf/tcp.h): ten u32; the sixth, how
    often a CPU looks at capture_chunks' fill, follows from its threshold;
    the eighth, the record kinds, is every kind unless the apply names them;
    the last two, sampling, off (threshold 0, 1 in 1) unless it asks."""
    assert len(value) == 40
    d = dict(zip(("flags", "cgroup_levels", "max_payload_bytes", "wakeup_bytes", "eof_wakeup_bytes",
                  "wakeup_check_bytes", "obs_wakeup_bytes", "records", "sample_threshold", "sample_connections"),
                 struct.unpack("<IIIIIIIIII", value)))
    assert d.pop("wakeup_check_bytes") == wakeup_check_bytes(d["wakeup_bytes"])
    assert d.pop("records") == 0b1111111111111111110   # NETTAP_KIND_* 1 .. 18
    assert (d.pop("sample_threshold"), d.pop("sample_connections")) == (0, 1)
    return d


def test_wakeup_check_bytes_bound_the_overshoot():
    # all CPUs late together overshoot the threshold by at most a quarter of it
    for cpus in (1, 2, 64, 512):
        check = wakeup_check_bytes(2 << 20, cpus)
        assert check * cpus <= (2 << 20) // 4
    assert wakeup_check_bytes(2 << 20, 2) == 256 << 10
    # a small ring on many CPUs: the bound holds (a look at nearly every call)
    assert wakeup_check_bytes(16 << 10, 64) * 64 <= (16 << 10) // 4
    assert wakeup_check_bytes(100, 512) == 1


def port_word(value):
    return int.from_bytes(value, "little")


def test_apply_first(calls):
    tm = TargetMaps(FDS)
    new = Resolved(pids={100, 200}, cgroups={7: 2}, netns={4026531992}, ports={80, 443, 8080})
    tm.apply(new, 4096, {"capture_chunks": 1 << 20, "capture_eof": 1 << 16, "obs_events": 1 << 15})
    ci = config_index(calls)
    before, after = calls[:ci], calls[ci + 1:]
    assert after == []                                     # nothing to delete
    assert all(c[0] == "update" for c in before)
    assert {c[2] for c in before if c[1] == "capture_pids"} == {u32(100), u32(200)}
    assert [c[2:] for c in before if c[1] == "capture_cgroups"] == [(u64(7), u32(1))]
    assert [c[2:] for c in before if c[1] == "capture_netns"] == [(u32(4026531992), u32(1))]
    # each port target's entry (read where a connection is decided): what it asks
    assert {c[2]: c[3] for c in before if c[1] == "capture_port_kinds"} == dict.fromkeys(map(u32, (80, 443, 8080)),
                                                                                      u32(1))
    ports = {int.from_bytes(c[2], "little"): port_word(c[3]) for c in before if c[1] == "capture_ports"}
    assert ports == {1: 1 << (80 - 64), 6: 1 << (443 - 384), 126: 1 << (8080 - 126 * 64)}
    assert all(len(c[3]) == 8 for c in before if c[1] == "capture_ports")
    assert decode_config(calls[ci][3]) == {"flags": 15, "cgroup_levels": 1 << 2,
                                           "max_payload_bytes": 4096, "wakeup_bytes": 1 << 20,
                                           "eof_wakeup_bytes": 1 << 16, "obs_wakeup_bytes": 1 << 15}
    assert calls[ci][2] == u32(0)
    assert tm.current is new


def test_apply_change_adds_before_config_deletes_after(calls):
    tm = TargetMaps(FDS)
    tm.apply(Resolved(pids={100, 200}, cgroups={7: 2, 8: 3}, netns={1, 2}, ports={80, 443}), 4096, WAKE)
    calls.clear()
    tm.apply(Resolved(pids={200, 300}, cgroups={8: 3, 9: 1}, netns={2, 3}, ports={80, 81, 8080}), 2048, WAKE)
    ci = config_index(calls)
    before, after = calls[:ci], calls[ci + 1:]
    assert all(c[0] == "update" for c in before) and all(c[0] == "delete" for c in after if c[1] != "capture_pid_bits")
    assert sorted((c[1], c[2]) for c in before if c[1] not in ("capture_ports", "capture_pid_bits")) == sorted([
        ("capture_pids", u32(300)), ("capture_cgroups", u64(9)), ("capture_netns", u32(3)),
        ("capture_port_kinds", u32(81)), ("capture_port_kinds", u32(8080))])
    # the pids' prefilter: word (pid >> 6) & 1023, bit pid & 63, before the config
    # (300 added, before the config; 100's bit cleared after it, with the entries)
    pid_bits = [(int.from_bytes(c[2], "little"), port_word(c[3])) for c in calls if c[1] == "capture_pid_bits"]
    assert pid_bits == [(4, 1 << (300 - 256)), (1, 0)]
    assert calls.index(("update", "capture_pid_bits", u32(1), u64(0))) > ci
    assert sorted(c for c in after if c[1] != "capture_pid_bits") == sorted([
        ("delete", "capture_pids", u32(100)), ("delete", "capture_cgroups", u64(7)),
        ("delete", "capture_netns", u32(1)), ("delete", "capture_port_kinds", u32(443))])
    # port words: word 1 (80 -> 80, 81) changed, word 6 (443 gone) changed to 0, word 126 new
    ports = {int.from_bytes(c[2], "little"): port_word(c[3]) for c in before if c[1] == "capture_ports"}
    assert ports == {1: (1 << 16) | (1 << 17), 6: 0, 126: 1 << (8080 - 126 * 64)}
    assert decode_config(calls[ci][3]) == {"flags": 15, "cgroup_levels": (1 << 3) | (1 << 1),
                                           "max_payload_bytes": 2048, "wakeup_bytes": 1024,
                                           "eof_wakeup_bytes": 256, "obs_wakeup_bytes": 128}


def test_apply_same_targets_writes_only_config(calls):
    tm = TargetMaps(FDS)
    r = Resolved(pids={1}, cgroups={7: 2}, netns={5}, ports={22, 65535})
    tm.apply(r, 4096, WAKE)
    calls.clear()
    tm.apply(Resolved(pids={1}, cgroups={7: 2}, netns={5}, ports={22, 65535}), 4096, WAKE)
    assert [c[1] for c in calls] == ["capture_config"]


def test_apply_ports_only_changed_words(calls):
    tm = TargetMaps(FDS)
    tm.apply(Resolved(ports={1, 2, 64, 65535}), 4096, WAKE)
    first = {int.from_bytes(c[2], "little"): port_word(c[3]) for c in calls if c[1] == "capture_ports"}
    assert first == {0: 0b110, 1: 1, 1023: 1 << 63}
    calls.clear()
    tm.apply(Resolved(ports={1, 2, 65, 65535}), 4096, WAKE)      # word 1 changes only
    words = [(int.from_bytes(c[2], "little"), port_word(c[3])) for c in calls if c[1] == "capture_ports"]
    assert words == [(1, 2)]
    calls.clear()
    tm.apply(Resolved(), 4096, WAKE)                             # all cleared: zeros written
    words = {int.from_bytes(c[2], "little"): port_word(c[3]) for c in calls if c[1] == "capture_ports"}
    assert words == {0: 0, 1: 0, 1023: 0}
    assert decode_config(calls[config_index(calls)][3])["flags"] == 0


def test_apply_to_empty_deletes_everything_after_config(calls):
    tm = TargetMaps(FDS)
    tm.apply(Resolved(pids={1, 2}, cgroups={3: 1}, netns={4}), 4096, WAKE)
    calls.clear()
    tm.apply(Resolved(), 4096, WAKE)
    assert calls[0][1] == "capture_config"
    assert decode_config(calls[0][3]) == {"flags": 0, "cgroup_levels": 0,
                                          "max_payload_bytes": 4096, "wakeup_bytes": 1024,
                                          "eof_wakeup_bytes": 256, "obs_wakeup_bytes": 128}
    assert sorted(calls[1:]) == sorted([("delete", "capture_pids", u32(1)), ("delete", "capture_pids", u32(2)),
                                        ("delete", "capture_cgroups", u64(3)),
                                        ("delete", "capture_netns", u32(4)),
                                        ("update", "capture_pid_bits", u32(0), u64(0))])


def test_apply_failure_keeps_previous_state(calls, monkeypatch):
    """A failed write leaves current as it was, so the next apply writes the
    whole difference again."""
    tm = TargetMaps(FDS)
    tm.apply(Resolved(pids={1}), 4096, WAKE)

    def boom(fd, key, value, flags=0):
        raise OSError(12, "bpf_map_update_elem: Cannot allocate memory")
    monkeypatch.setattr(maps, "update", boom)
    with pytest.raises(OSError):
        tm.apply(Resolved(pids={1, 2}, ports={80}), 4096, WAKE)
    assert tm.current.pids == {1}
    monkeypatch.undo()
    log = []
    monkeypatch.setattr(maps, "update", lambda fd, key, value, flags=0: log.append((NAMES[fd], key)))
    monkeypatch.setattr(maps, "delete", lambda fd, key: log.append(("delete", NAMES[fd], key)))
    tm.apply(Resolved(pids={1, 2}, ports={80}), 4096, WAKE)
    assert log == [("capture_pids", u32(2)), ("capture_port_kinds", u32(80)), ("capture_ports", u32(1)),
                   ("capture_pid_bits", u32(0)), ("capture_config", u32(0))]


def test_kinds_ask_more_of_their_entries(calls):
    """A target's record kinds are in its entry's value (NETTAP_MATCH_CAPTURE,
    bit 0, and 1 << NETTAP_KIND_* each): a port's in capture_port_kinds; the
    config's flags say some target wants segments. Asking less rewrites the
    entries, before the config."""
    tm = TargetMaps(FDS)
    tm.apply(Resolved(pids={1, 2}, netns={5}, ports={80, 443}, kinds={("pid", 2): SEG, ("netns", 5): SEG,
                                                                      ("port", 80): SEG}), 4096, WAKE)
    pids = {c[2]: c[3] for c in calls if c[1] == "capture_pids"}
    assert pids == {u32(1): u32(1), u32(2): u32(1 | SEG)}
    assert [c[3] for c in calls if c[1] == "capture_netns"] == [u32(1 | SEG)]
    assert {c[2]: c[3] for c in calls if c[1] == "capture_port_kinds"} == {u32(80): u32(1 | SEG), u32(443): u32(1)}
    ports = {int.from_bytes(c[2], "little"): port_word(c[3]) for c in calls if c[1] == "capture_ports"}
    assert ports == {1: 1 << 16, 6: 1 << (443 - 384)}
    flags = decode_config(calls[config_index(calls)][3])["flags"]
    assert flags & tcp_h.TARGET_SEGMENTS and flags & tcp_h.TARGET_PID
    calls.clear()
    tm.apply(Resolved(pids={1, 2}, netns={5}, ports={80, 443}), 4096, WAKE)
    ci = config_index(calls)
    assert sorted(c[1:] for c in calls[:ci]) == sorted([
        ("capture_netns", u32(5), u32(1)), ("capture_pids", u32(2), u32(1)), ("capture_port_kinds", u32(80), u32(1))])
    assert calls[ci + 1:] == [] and not decode_config(calls[ci][3])["flags"] & tcp_h.TARGET_SEGMENTS


def test_a_failed_kinds_change_restores_each_entry(calls, monkeypatch):
    tm = TargetMaps(FDS)
    tm.apply(Resolved(pids={1, 2}, kinds={("pid", 1): SEG}), 4096, WAKE)
    calls.clear()
    real = maps.update

    def fail_on_config(fd, key, value, flags=0):
        if NAMES[fd] == "capture_config":
            raise OSError(1, "bpf_map_update_elem: Operation not permitted")
        real(fd, key, value, flags)
    monkeypatch.setattr(maps, "update", fail_on_config)
    with pytest.raises(OSError):
        tm.apply(Resolved(pids={1, 2, 3}, kinds={("pid", 2): SEG}), 4096, WAKE)
    # written: 1 -> 1, 2 -> 1 | SEG, 3 new; undone: each back as it was, 3 deleted
    done = [c for c in calls if c[1] == "capture_pids"]
    assert done[:3] == [("update", "capture_pids", u32(1), u32(1)), ("update", "capture_pids", u32(2), u32(1 | SEG)),
                        ("update", "capture_pids", u32(3), u32(1))]
    assert sorted(done[3:]) == sorted([("update", "capture_pids", u32(1), u32(1 | SEG)),
                                      ("update", "capture_pids", u32(2), u32(1)),
                                      ("delete", "capture_pids", u32(3))])
    assert tm.current.kinds == {("pid", 1): SEG}


def test_kinds_resolved_per_target(tmp_path):
    from exporter.capture.targets import kind_bits
    r = resolve([Target("port", 80, True, ("eof", "segment")), Target("port", 443, False, ("chunk",)),
                 Target("pid", os.getpid(), True, ("segment",)), Target("port", 80, False, ("owner",))])
    # a target named twice asks for what either names
    assert r.kinds == {("port", 80): kind_bits(("eof", "segment", "owner")), ("port", 443): kind_bits(("chunk",)),
                       ("pid", os.getpid()): SEG} and r.ports == {80, 443}
    assert r.flags & tcp_h.TARGET_SEGMENTS
    assert not resolve([Target("port", 80, False, ("chunk",))]).flags & tcp_h.TARGET_SEGMENTS
    gone = r.without({("pid", os.getpid())})
    assert ("pid", os.getpid()) not in gone.kinds and len(gone.kinds) == 2


def test_more_cgroup_levels_than_the_kernel_matches_refused(tmp_path):
    # The programs match at most MAX_CGROUP_LEVELS distinct levels at once.
    from exporter.kernel.tcp_h import MAX_CGROUP_LEVELS
    mnt = tmp_path / "cg2"
    path = mnt
    targets = []
    for i in range(MAX_CGROUP_LEVELS + 1):
        path = path / f"l{i}"
        path.mkdir(parents=True)
        targets.append(Target("cgroup", str(path)))
    mi = tmp_path / "mountinfo"
    mi.write_text(f"30 1 0:26 / {mnt} rw - cgroup2 cgroup2 rw\n")
    import exporter.capture.targets as T
    orig = T.cgroup_id_level
    T.cgroup_id_level = lambda p: orig(p, str(mi))
    try:
        assert len(resolve(targets[:MAX_CGROUP_LEVELS]).cgroups) == MAX_CGROUP_LEVELS
        with pytest.raises(ConfigError, match=f"5 different levels .* at most {MAX_CGROUP_LEVELS}"):
            resolve(targets)
    finally:
        T.cgroup_id_level = orig


# ---- TargetMaps.apply as a transaction, and the maps' capacity -----------------

class FakeKernel:
    """The target maps as the kernel keeps them: dicts that refuse a new key
    once max_entries are in (E2BIG, as kernel/bpf/hashtab.c does)."""

    def __init__(self, monkeypatch, capacity=1024):
        self.capacity = capacity
        self.m = {name: {} for name in FDS}
        self.writes = 0
        monkeypatch.setattr(maps, "update", self.update)
        monkeypatch.setattr(maps, "delete", self.delete)

    def update(self, fd, key, value, flags=0):
        m = self.m[NAMES[fd]]
        if NAMES[fd] in ("capture_pids", "capture_cgroups", "capture_netns") and key not in m \
                and len(m) >= self.capacity:
            raise OSError(7, "bpf_map_update_elem: Argument list too long")
        self.writes += 1
        m[key] = value

    def delete(self, fd, key):
        self.m[NAMES[fd]].pop(key, None)

    def state(self):
        """Array maps hold zeros where nothing was written."""
        return {name: {k: v for k, v in m.items() if name not in ("capture_ports", "capture_config") or any(v)}
                for name, m in self.m.items()}

    def pids(self):
        return {int.from_bytes(k, "little") for k in self.m["capture_pids"]}


INFO = {name: (1, 4, 1, 1024) for name in ("capture_pids", "capture_cgroups", "capture_netns")}


def test_over_capacity_refused_up_front_naming_the_limit(monkeypatch):
    k = FakeKernel(monkeypatch)
    tm = TargetMaps(FDS, {**INFO, "capture_pids": (1, 4, 1, 1000)})     # read from max_entries
    tm.apply(Resolved(pids={1, 2}), 4096, WAKE)
    before, writes = k.state(), k.writes
    with pytest.raises(ConfigError, match=r"^captures: 1001 pid targets, more than the 1000 the kernel "
                                          r"map capture_pids holds \(its max_entries\)$"):
        tm.apply(Resolved(pids=range(1, 1002)), 4096, WAKE)
    assert k.writes == writes and k.state() == before and tm.current.pids == {1, 2}
    tm.apply(Resolved(pids=range(1, 1001)), 4096, WAKE)                 # exactly full: fine
    assert len(k.pids()) == 1000


def test_failed_write_rolls_back_to_the_old_state_exactly(monkeypatch):
    """A write the kernel refuses midway (here: the capacity check passed a
    map that holds less) leaves the maps as they were, and a later valid
    config leaves none of the refused one's entries behind."""
    k = FakeKernel(monkeypatch)
    tm = TargetMaps(FDS)                                   # no map_info: no check up front
    tm.apply(Resolved(pids={1, 2, 3}, cgroups={7: 1}, ports={80}), 4096, WAKE)
    before = k.state()
    with pytest.raises(OSError):
        tm.apply(Resolved(pids=range(100, 1200), cgroups={8: 2}, ports={443}), 2048, WAKE)
    assert k.state() == before
    assert tm.current.pids == {1, 2, 3}
    tm.apply(Resolved(pids={1, 5}), 4096, WAKE)
    assert k.pids() == {1, 5} and k.m["capture_cgroups"] == {}


def test_failed_config_write_undoes_the_added_entries(monkeypatch):
    k = FakeKernel(monkeypatch)
    tm = TargetMaps(FDS, INFO)
    tm.apply(Resolved(pids={1}, netns={9}), 4096, WAKE)
    before = k.state()
    real = k.update

    def refuse_config(fd, key, value, flags=0):
        if NAMES[fd] == "capture_config" and value != before["capture_config"][u32(0)]:
            raise OSError(12, "bpf_map_update_elem: Cannot allocate memory")
        real(fd, key, value, flags)
    monkeypatch.setattr(maps, "update", refuse_config)
    with pytest.raises(OSError):
        tm.apply(Resolved(pids={2}, netns={10}, ports={22}), 4096, WAKE)
    assert k.state() == before and tm.current.pids == {1}


def test_old_and_new_together_over_capacity_removes_stale_first(monkeypatch):
    """1,000 pids replaced by 1,000 others with 1,024 entries: the map
    cannot hold both at once, so the stale ones go before the new come."""
    k = FakeKernel(monkeypatch)
    tm = TargetMaps(FDS, INFO)
    tm.apply(Resolved(pids=range(1, 1001)), 4096, WAKE)
    tm.apply(Resolved(pids=range(2001, 3001)), 4096, WAKE)
    assert k.pids() == set(range(2001, 3001))


# ---- gone targets: a pid's process exited, a cgroup was removed ----------------

def test_start_time_after_a_command_name_with_parentheses(tmp_path):
    proc = fake_proc(tmp_path, p123=123, start=987654)
    assert targets.start_time(proc, 123) == 987654
    assert targets.start_time(proc, 124) is None
    assert targets.start_time("/proc", os.getpid()) == int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])


def test_reused_pid_is_gone_not_refused_and_not_captured(tmp_path):
    proc = fake_proc(tmp_path, p123=123, p200=200)
    first = resolve([Target("pid", 123), Target("pid", 200)], proc=proc)
    assert first.pids == {123, 200} and first.pid_starts == {123: 5000, 200: 5000}
    set_start(proc, 123, 7777)                         # 123 exited; another process has the pid now
    again = resolve([Target("pid", 123), Target("pid", 200), Target("port", 80)], proc=proc, previous=first)
    assert again.pids == {200} and again.gone == {("pid", 123)} and again.ports == {80}
    # Still gone at the next edit, although a process has the pid.
    third = resolve([Target("pid", 123)], proc=proc, previous=again)
    assert third.pids == set() and third.gone == {("pid", 123)}
    # Removed from the config and added again: the process that has it now.
    fourth = resolve([Target("pid", 123)], proc=proc, previous=resolve([], proc=proc, previous=third))
    assert fourth.pids == {123} and fourth.pid_starts == {123: 7777} and fourth.gone == set()


def test_exited_pid_in_force_is_reported_but_a_new_missing_pid_refused(tmp_path):
    proc = fake_proc(tmp_path, p123=123)
    first = resolve([Target("pid", 123)], proc=proc)
    for f in ("stat", "status"):
        (tmp_path / "123" / f).unlink()
    assert resolve([Target("pid", 123)], proc=proc, previous=first).gone == {("pid", 123)}
    with pytest.raises(ConfigError, match=r"captures\[1\]\.pid: pid 124: no such process"):
        resolve([Target("pid", 123), Target("pid", 124)], proc=proc, previous=first)


def test_removed_cgroup_in_force_is_reported_but_a_new_missing_one_refused(tmp_path, cg, monkeypatch):
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    real = targets.cgroup_id_level
    monkeypatch.setattr(targets, "cgroup_id_level", lambda p: real(p, mi))
    (cg / "c").mkdir()
    first = resolve([Target("cgroup", str(cg / "c"))])
    assert first.cgroup_paths == {str(cg / "c"): os.stat(cg / "c").st_ino}
    (cg / "c").rmdir()
    again = resolve([Target("cgroup", str(cg / "c")), Target("port", 1)], previous=first)
    assert again.cgroups == {} and again.gone == {("cgroup", str(cg / "c"))}
    with pytest.raises(ConfigError, match=r"captures\[1\]\.cgroup: .*no such cgroup directory"):
        resolve([Target("cgroup", str(cg / "c")), Target("cgroup", str(cg / "d"))], previous=first)


def test_drop_gone_removes_from_the_maps_and_counts(tmp_path, cg, monkeypatch):
    k = FakeKernel(monkeypatch)
    proc = fake_proc(tmp_path, p123=123, p200=200)
    mi = mountinfo(tmp_path, ("cgroup2", cg, "/"))
    real = targets.cgroup_id_level
    monkeypatch.setattr(targets, "cgroup_id_level", lambda p: real(p, mi))
    tm = TargetMaps(FDS, INFO, proc=proc)
    tm.apply(resolve([Target("pid", 123), Target("pid", 200), Target("cgroup", str(cg / "a" / "b"))], proc=proc),
             4096, WAKE)
    assert k.pids() == {123, 200} and len(k.m["capture_cgroups"]) == 1
    assert tm.drop_gone() == []
    set_start(proc, 123, 6000)                                  # pid reused
    assert tm.drop_gone(pids={123}) == [("pid", 123)]
    assert k.pids() == {200} and tm.current.gone == {("pid", 123)}
    assert tm.drop_gone(exited={200}) == [("pid", 200)]         # its pidfd said it exited
    assert k.pids() == set() and decode_config(k.m["capture_config"][u32(0)])["flags"] == TARGET_CGROUP
    (cg / "a" / "b").rmdir()
    assert tm.drop_gone() == [("cgroup", str(cg / "a" / "b"))]
    assert k.m["capture_cgroups"] == {} and decode_config(k.m["capture_config"][u32(0)])["flags"] == 0
    assert tm.gone_total == {"pid": 2, "cgroup": 1}
    fam = TargetsCollector(tm).collect()[0]
    assert fam.name == "nettap_targets_gone" and fam.type == "counter"
    assert {s.labels["kind"]: s.value for s in fam.samples if s.name.endswith("_total")} == {"pid": 2, "cgroup": 1}


def test_watch_drops_an_exited_child_at_once(tmp_path, monkeypatch):
    """TargetWatch with a real process: its pidfd wakes the watch when it exits."""
    import subprocess
    import sys
    import time
    k = FakeKernel(monkeypatch)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    tm = TargetMaps(FDS, INFO)
    lock = threading.Lock()
    tm.apply(resolve([Target("pid", child.pid)]), 4096, WAKE)
    watch = capture_filter.TargetWatch(tm, lock, interval=30).start()     # no periodic look: the pidfd wakes it
    try:
        time.sleep(0.2)
        assert k.pids() == {child.pid}
        child.stdin.close()
        child.wait(10)
        end = time.time() + 30                      # the map entry goes first, then the count
        while (k.pids() or tm.gone_total["pid"] != 1) and time.time() < end:
            time.sleep(0.01)
        assert k.pids() == set() and tm.gone_total["pid"] == 1
    finally:
        watch.stop()


# ---- cgroup levels inside a private cgroup namespace -------------------------

def cgroup_dirs(base: Path, *rel) -> None:
    """Non-root cgroup directories below base (each has cgroup.events, which
    only the hierarchy's root lacks)."""
    for r in rel:
        d = base / r
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.events").write_text("populated 0\nfrozen 0\n")


def test_level_in_a_pod_from_the_hosts_hierarchy_mounted(tmp_path):
    """The shipped DaemonSet: the pod's own cgroup2 at /sys/fs/cgroup (its
    namespace root shows as "/"), the host's at /host/sys/fs/cgroup, whose root
    shows as "/.." once per level of the pod's cgroup (here 3). The ConfigMap's
    example target sits at level 3 of the host's hierarchy."""
    own, host = tmp_path / "sys-fs-cgroup", tmp_path / "host-sys-fs-cgroup"
    pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0123.slice"
    cgroup_dirs(own, ".", "sub")
    host.mkdir()
    cgroup_dirs(host, pod, pod + "/cri-containerd-abc.scope")
    mi = mountinfo(tmp_path, ("cgroup2", own, "/"), ("cgroup2", host, "/../../.."))
    assert cgroup_id_level(str(host / pod), mi, initial_ns=False) == (os.stat(host / pod).st_ino, 3)
    assert cgroup_id_level(str(host / pod / "cri-containerd-abc.scope"), mi, initial_ns=False)[1] == 4
    assert cgroup_id_level(str(host), mi, initial_ns=False)[1] == 0
    assert cgroup_id_level(str(own / "sub"), mi, initial_ns=False)[1] == 4      # below the namespace root (3)


def test_level_in_a_namespace_from_a_mount_of_a_sibling(tmp_path):
    """A mount whose root is elsewhere in the hierarchy shows as "/../x"."""
    host, other = tmp_path / "host", tmp_path / "other"
    host.mkdir()
    cgroup_dirs(host, "a/b")
    cgroup_dirs(other, ".", "y")
    mi = mountinfo(tmp_path, ("cgroup2", host, "/../.."), ("cgroup2", other, "/../x"))   # ns root at level 2
    assert cgroup_id_level(str(other / "y"), mi, initial_ns=False)[1] == 3              # /a/x/y: 2 - 1 + 1 + 1


def test_level_in_a_namespace_without_the_hierarchys_root_refused(tmp_path):
    own = tmp_path / "own"
    cgroup_dirs(own, ".", "sub")
    mi = mountinfo(tmp_path, ("cgroup2", own, "/"))
    with pytest.raises(ConfigError, match=r"private cgroup namespace .* mount the host's cgroup2 root"):
        cgroup_id_level(str(own / "sub"), mi, initial_ns=False)
    # the same mount in the initial namespace: "/" is the hierarchy's root
    assert cgroup_id_level(str(own / "sub"), mi, initial_ns=True)[1] == 1


def test_initial_cgroup_namespace_is_recognised_by_its_inode(tmp_path):
    assert targets.CGROUP_NS_INIT_INO == 4026531835          # PROC_CGROUP_INIT_INO
    (tmp_path / "ns").write_text("")
    assert targets.in_initial_cgroup_ns(str(tmp_path / "ns")) is False
    assert targets.in_initial_cgroup_ns("/no/such/ns") is True   # no cgroup namespaces: paths are global


def test_a_pods_change_rematches_only_the_kubernetes_targets(tmp_path):
    """The daemon's _kube_changed: the kubernetes targets' cgroups replaced,
    every other target kept as resolved at the last apply, even a netns
    target whose namespace has no holder now (re-resolving it failed and
    stopped the pod-following)."""
    from exporter.util.kubeconfig import Selector

    class Node:
        def __init__(self, found):
            self.found = found

        def match(self, sel):
            return self.found
    proc = fake_netns_proc(tmp_path, {1: 4026531840, 77: 4026532001})
    fake_proc(Path(proc), p123=123)
    sel = Selector("shop", "checkout-*")
    captures = [Target("netns", 4026532001, records=("owner",)), Target("pid", 123),
                Target("kubernetes", sel, records=("eof",))]
    cur = resolve(captures, proc=proc, kube=Node({11: 3}))
    assert cur.cgroups == {11: 3} and cur.matched == {str(sel): [11]} and cur.pids == {123}
    shutil.rmtree(proc + "/77")                             # the namespace's holder exited
    with pytest.raises(ConfigError):
        resolve(captures, proc=proc, previous=cur, kube=Node({12: 3}))
    new = targets.with_kubernetes(cur, captures, Node({12: 3}))
    assert new.netns == {4026532001} and new.cgroups == {12: 3} and new.matched == {str(sel): [12]}
    assert new.pids == {123} and new.kinds == {("netns", 4026532001): targets.kind_bits(["owner"]),
                                               ("cgroup", 12): targets.kind_bits(["eof"])}
    again = targets.with_kubernetes(new.without({("pid", 123)}), captures, Node({13: 3}))
    assert again.cgroups == {13: 3} and again.netns == {4026532001} and not again.pids   # gone stays gone
    assert again.gone == {("pid", 123)}
