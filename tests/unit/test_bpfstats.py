"""exporter.bpfstats without root: StatsSwitch against a temp file standing in
for kernel.bpf_stats_enabled and a fake BPF_ENABLE_STATS; ProgramStatsCollector
with the kernel reads monkeypatched."""
from __future__ import annotations

import errno
import os
import threading

import pytest

from exporter import bpfstats, fdinfo
from exporter.bpfstats import ProgramStatsCollector, StatsSwitch


class FakeEnable:
    """BPF_ENABLE_STATS: returns a real fd (a pipe's read end) or refuses."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.calls = 0
        self.fds = []
        self._w = []

    def __call__(self) -> int:
        self.calls += 1
        if self.refuse:
            raise OSError(errno.EINVAL, "bpf_enable_stats: Invalid argument")
        r, w = os.pipe()
        self.fds.append(r)
        self._w.append(w)
        return r

    def cleanup(self):
        for fd in self._w:
            os.close(fd)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def sysctl(tmp_path):
    p = tmp_path / "bpf_stats_enabled"
    p.write_text("0\n")
    return p


@pytest.fixture
def enable():
    e = FakeEnable()
    yield e
    e.cleanup()


def read(p) -> str:
    return p.read_text().strip()


# ---- StatsSwitch --------------------------------------------------------------

def test_fd_path(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    assert sw.source() is None and not sw.wanted
    sw.set(False)
    assert not sw.wanted and enable.calls == 0
    sw.set(True)
    assert enable.calls == 1
    fd = sw.fd
    assert fd == enable.fds[0] and is_open(fd)
    assert sw.source() == "fd" and sw.wanted
    assert read(sysctl) == "0"                  # the sysctl is not touched
    sw.set(False)
    assert sw.fd is None and not is_open(fd)    # off closes the fd
    assert sw.source() is None and not sw.wanted
    assert read(sysctl) == "0"


def test_fd_refused_falls_back_to_sysctl(sysctl):
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    assert read(sysctl) == "1"
    assert sw.source() == "sysctl" and sw.wanted and sw.set_sysctl
    sw.set(False)
    assert read(sysctl) == "0"                  # nettap set it: nettap sets it back
    assert sw.source() is None and not sw.wanted


def test_fd_refused_and_sysctl_already_on_is_left_alone(sysctl):
    sysctl.write_text("1\n")
    before = sysctl.stat().st_mtime_ns
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    assert sw.source() == "external" and not sw.set_sysctl
    sw.set(False)
    sw.close()
    assert read(sysctl) == "1"                  # someone else's: never switched off
    assert sysctl.stat().st_mtime_ns == before  # never written at all
    assert sw.source() == "external"


def test_external_sysctl_still_counts_as_wanted(sysctl):
    """Asked for and on by another tool's doing: wanted, so nettap's own
    program series are exported (they were dropped before wanted followed
    the request)."""
    sysctl.write_text("1\n")
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    assert sw.wanted and sw.source() == "external"
    sw.set(False)
    assert not sw.wanted and sw.source() == "external"
    assert read(sysctl) == "1"


def test_external_wanted_exports_own_programs(sysctl, monkeypatch):
    monkeypatch.setattr(bpfstats, "own_program_stats", lambda fds: {"tcp_state": (5, 1000)})
    sysctl.write_text("1\n")
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    f = {m.name: m for m in ProgramStatsCollector(sw, lambda: {"tcp_state": 3}, lambda: "own").collect()}
    assert [(s.labels, s.value) for s in f["nettap_bpf_stats_source"].samples] == [({"source": "external"}, 1)]
    assert [(s.labels, s.value) for s in f["nettap_bpf_program_runs"].samples] == [({"program": "tcp_state"}, 5)]


def test_external_when_off_and_sysctl_on(sysctl, enable):
    """source() reports another tool's sysctl even when nettap never asked."""
    sysctl.write_text("1")
    sw = StatsSwitch(str(sysctl), enable)
    assert sw.source() == "external" and not sw.wanted


def test_unreadable_sysctl_is_off(tmp_path, enable):
    sw = StatsSwitch(str(tmp_path / "missing"), enable)
    assert sw.source() is None


def test_set_true_twice_is_idempotent_fd(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    sw.set(True)
    fd = sw.fd
    sw.set(True)
    assert enable.calls == 1 and sw.fd == fd and is_open(fd)
    sw.close()
    assert not is_open(fd)


def test_set_true_twice_is_idempotent_sysctl(sysctl):
    en = FakeEnable(refuse=True)
    sw = StatsSwitch(str(sysctl), en)
    sw.set(True)
    mtime = sysctl.stat().st_mtime_ns
    sw.set(True)
    assert en.calls == 1                         # not asked again
    assert sysctl.stat().st_mtime_ns == mtime and read(sysctl) == "1"
    sw.set(False)
    assert read(sysctl) == "0"


def test_set_false_when_off_does_nothing(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    mtime = sysctl.stat().st_mtime_ns
    sw.set(False)
    sw.close()
    assert enable.calls == 0 and sysctl.stat().st_mtime_ns == mtime


def test_close_turns_off_fd(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    sw.set(True)
    fd = sw.fd
    sw.close()
    assert not is_open(fd) and sw.source() is None
    sw.close()                                   # twice is fine


def test_close_turns_off_sysctl(sysctl):
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    sw.close()
    assert read(sysctl) == "0" and sw.source() is None


def test_on_off_on_again_fd(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    sw.set(True)
    sw.set(False)
    sw.set(True)
    assert enable.calls == 2 and sw.fd == enable.fds[1] and is_open(sw.fd)
    sw.close()


def test_sysctl_write_back_failure_is_logged_not_raised(tmp_path, caplog):
    p = tmp_path / "d" / "bpf_stats_enabled"
    p.parent.mkdir()
    p.write_text("0")
    sw = StatsSwitch(str(p), FakeEnable(refuse=True))
    sw.set(True)
    os.unlink(p)
    os.mkdir(p)                                  # opening it for writing now fails
    sw.set(False)
    assert not sw.set_sysctl
    assert "cannot switch" in caplog.text


def test_concurrent_set_takes_one_fd(sysctl, enable):
    sw = StatsSwitch(str(sysctl), enable)
    ts = [threading.Thread(target=sw.set, args=(True,)) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert enable.calls == 1
    sw.close()


# ---- ProgramStatsCollector ------------------------------------------------------

class FakeSwitch:
    def __init__(self, src, wanted):
        self._src, self.wanted = src, wanted

    def source(self):
        return self._src


def fams(coll):
    return {f.name: f for f in coll.collect()}


def samples(fam):
    return {tuple(s.labels.values()): s.value for s in fam.samples}


@pytest.fixture
def kernel(monkeypatch):
    calls = {"own": 0, "node": 0, "scan": 0}
    state = {"progs": [], "holders": {}}

    def own(fds):
        calls["own"] += 1
        return {n: (100 + i, 1_000_000 * (i + 1)) for i, n in enumerate(sorted(fds))}

    def node():
        calls["node"] += 1
        return list(state["progs"])

    def scan(proc_root="/proc"):
        calls["scan"] += 1
        return dict(state["holders"])

    monkeypatch.setattr(bpfstats, "own_program_stats", own)
    monkeypatch.setattr(bpfstats, "node_programs", node)
    monkeypatch.setattr(fdinfo, "scan_bpf_holders", scan)
    return calls, state


def test_series_absent_when_not_wanted(kernel):
    calls, _ = kernel
    c = ProgramStatsCollector(FakeSwitch(None, False), lambda: {"tcp_state": 3}, lambda: "node")
    f = fams(c)
    assert set(f) == {"nettap_bpf_stats_enabled", "nettap_bpf_stats_source"}
    assert samples(f["nettap_bpf_stats_enabled"]) == {(): 0}
    assert f["nettap_bpf_stats_source"].samples == []
    assert calls == {"own": 0, "node": 0, "scan": 0}          # nothing read


def test_external_not_wanted_reports_enabled_only(kernel):
    c = ProgramStatsCollector(FakeSwitch("external", False), lambda: {"tcp_state": 3}, lambda: "own")
    f = fams(c)
    assert samples(f["nettap_bpf_stats_enabled"]) == {(): 1}
    assert samples(f["nettap_bpf_stats_source"]) == {("external",): 1}
    assert "nettap_bpf_program_runs" not in f


def test_own_scope_has_no_node_series(kernel):
    calls, _ = kernel
    c = ProgramStatsCollector(FakeSwitch("fd", True), lambda: {"b_prog": 4, "a_prog": 3}, lambda: "own")
    f = fams(c)
    assert samples(f["nettap_bpf_program_runs"]) == {("a_prog",): 100, ("b_prog",): 101}
    assert samples(f["nettap_bpf_program_run_time_seconds"]) == {("a_prog",): 0.001, ("b_prog",): 0.002}
    assert not any(n.startswith("nettap_node_") for n in f)
    assert calls["node"] == 0 and calls["scan"] == 0


def test_node_aggregation(kernel):
    calls, state = kernel
    state["progs"] = [
        (1, b"sd_devices", 15, 10, 1000),
        (2, b"sd_devices", 15, 20, 2000),        # same (name, type, owner): summed
        (3, b"sd_devices", 15, 5, 500),          # same name and type, other owner
        (4, b"tcp_state", 26, 7, 7000),
        (5, b"tcp_state", 5, 1, 100),            # same name, other type
        (6, b"", 1, 2, 20),                      # nameless: id6
        (7, b"", 1, 3, 30),                      # nameless: id7, another series
        (8, b"\xff\xfebad", 99, 1, 1),           # undecodable name, unknown type
    ]
    state["holders"] = {1: fdinfo.Holder(1, "systemd"), 2: fdinfo.Holder(1, "systemd"),
                        3: fdinfo.Holder(77, "udevd"), 4: fdinfo.Holder(42, "nettap"),
                        5: fdinfo.Holder(42, "nettap")}
    c = ProgramStatsCollector(FakeSwitch("fd", True), lambda: {}, lambda: "node")
    f = fams(c)
    runs = {(s.labels["program"], s.labels["type"], s.labels["owner"]): s.value
            for s in f["nettap_node_bpf_program_runs"].samples}
    assert runs == {
        ("sd_devices", "cgroup_device", "systemd"): 30,
        ("sd_devices", "cgroup_device", "udevd"): 5,
        ("tcp_state", "tracing", "nettap"): 7,
        ("tcp_state", "tracepoint", "nettap"): 1,
        ("id6", "socket_filter", "none"): 2,
        ("id7", "socket_filter", "none"): 3,
        ("\ufffd\ufffdbad", "99", "none"): 1,
    }
    rt = {(s.labels["program"], s.labels["owner"]): s.value
          for s in f["nettap_node_bpf_program_run_time_seconds"].samples}
    assert rt[("sd_devices", "systemd")] == pytest.approx(3e-6)
    count = {(s.labels["type"], s.labels["owner"]): s.value for s in f["nettap_node_bpf_programs"].samples}
    assert count == {("cgroup_device", "systemd"): 2, ("cgroup_device", "udevd"): 1,
                     ("tracing", "nettap"): 1, ("tracepoint", "nettap"): 1,
                     ("socket_filter", "none"): 2, ("99", "none"): 1}
    assert sum(count.values()) == len(state["progs"])


def test_holder_scan_only_when_new_ids_appear(kernel):
    calls, state = kernel
    state["progs"] = [(1, b"a", 1, 1, 1), (2, b"b", 1, 1, 1)]
    state["holders"] = {1: fdinfo.Holder(1, "x")}
    c = ProgramStatsCollector(FakeSwitch("fd", True), lambda: {}, lambda: "node")
    fams(c)
    assert calls["scan"] == 1
    fams(c)
    assert calls["scan"] == 1                   # same ids: no rescan
    state["progs"] = [(1, b"a", 1, 1, 1)]       # one unloaded: still no rescan
    fams(c)
    assert calls["scan"] == 1
    state["progs"] = [(1, b"a", 1, 1, 1), (3, b"c", 1, 1, 1)]
    state["holders"] = {1: fdinfo.Holder(1, "x"), 3: fdinfo.Holder(9, "y")}
    f = fams(c)
    assert calls["scan"] == 2
    owners = {s.labels["program"]: s.labels["owner"] for s in f["nettap_node_bpf_program_runs"].samples}
    assert owners == {"a": "x", "c": "y"}


def test_scope_is_read_each_scrape(kernel):
    calls, _ = kernel
    scope = {"v": "own"}
    c = ProgramStatsCollector(FakeSwitch("sysctl", True), lambda: {}, lambda: scope["v"])
    assert "nettap_node_bpf_programs" not in fams(c)
    scope["v"] = "node"
    assert "nettap_node_bpf_programs" in fams(c)


def test_describe_reads_nothing(kernel):
    calls, _ = kernel

    class Explodes:
        wanted = True

        def source(self):
            raise AssertionError("read at describe")

    c = ProgramStatsCollector(Explodes(), lambda: 1 / 0, lambda: 1 / 0)
    names = {m.name for m in c.describe()}
    assert "nettap_node_bpf_programs" in names and "nettap_bpf_stats_source" in names
    assert calls == {"own": 0, "node": 0, "scan": 0}


def test_prog_info_layout():
    """struct bpf_prog_info offsets the reader relies on (uapi/linux/bpf.h)."""
    s = bpfstats.bpf_prog_info
    assert (s.type.offset, s.id.offset, s.tag.offset) == (0, 4, 8)
    assert s.name.offset == 64 and s.run_time_ns.offset == 192 and s.run_cnt.offset == 200


def test_fd_refused_and_sysctl_unwritable_raises_and_stays_off(tmp_path):
    """Where neither works (e.g. a read-only /proc/sys in a container) set()
    raises OSError and the switch stays off. NB: Nettap.reload catches only
    ConfigError, so this escapes a reload half-applied (see the report)."""
    sw = StatsSwitch(str(tmp_path / "no" / "such" / "bpf_stats_enabled"), FakeEnable(refuse=True))
    with pytest.raises(OSError):
        sw.set(True)
    assert sw.fd is None and not sw.set_sysctl and sw.source() is None
    sw.close()
    assert not sw.wanted
