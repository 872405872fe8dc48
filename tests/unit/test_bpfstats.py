"""exporter.kernel.bpfstats without root: StatsSwitch against a temp file standing in
for kernel.bpf_stats_enabled and a fake BPF_ENABLE_STATS; ProgramStatsCollector
with the kernel reads monkeypatched."""
from __future__ import annotations

import ctypes
import errno
import os
import threading

import pytest

from exporter.kernel import bpfstats, fdinfo
from exporter.kernel.bpfstats import StatsSwitch
from exporter.metrics.programs import ProgramStatsCollector


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
    monkeypatch.setattr(bpfstats, "own_programs", lambda fds: {"tcp_state": (5, 1000, 0)})
    sysctl.write_text("1\n")
    sw = StatsSwitch(str(sysctl), FakeEnable(refuse=True))
    sw.set(True)
    f = {m.name: m for m in ProgramStatsCollector(sw, lambda: {"tcp_state": 3}, lambda: "own").collect()}
    assert [(s.labels, s.value) for s in f["nettap_bpf_stats_source"].samples] == [({"source": "external"}, 1)]
    assert [(s.labels, s.value) for s in f["nettap_bpf_program_runs"].samples] == [({"program": "tcp_state"}, 5)]


def test_another_processes_stats_fd_is_reported_though_the_sysctl_reads_0(sysctl, enable, monkeypatch):
    """Another nettap holds BPF_ENABLE_STATS: the sysctl still reads 0 (it
    shows only what was written to it), the kernel's answer says on."""
    monkeypatch.setattr(bpfstats, "own_programs", lambda fds: {})
    sysctl.write_text("0\n")
    kernel = {"on": True}
    sw = StatsSwitch(str(sysctl), enable, kernel_on=lambda: kernel["on"])
    f = {m.name: m for m in ProgramStatsCollector(sw, lambda: {}, lambda: "own").collect()}
    assert [s.value for s in f["nettap_bpf_stats_enabled"].samples] == [1]
    assert [(s.labels, s.value) for s in f["nettap_bpf_stats_source"].samples] == [({"source": "external"}, 1)]
    sw.set(True)                                  # this one holds its own fd too: it says so
    assert sw.source() == "fd"
    sw.set(False)
    kernel["on"] = False
    assert sw.source() is None
    sysctl.write_text("1\n")                      # the kernel's answer wins over the sysctl's
    assert sw.source() is None
    kernel["on"] = None                           # unknown (no probe): the sysctl decides
    assert sw.source() == "external"


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
        return {n: (100 + i, 1_000_000 * (i + 1), 0) for i, n in enumerate(sorted(fds))}

    def node(full_names=None, walk=None):
        calls["node"] += 1
        return list(state["progs"])

    def scan(proc_root="/proc"):
        calls["scan"] += 1
        return dict(state["holders"])

    monkeypatch.setattr(bpfstats, "own_programs", own)
    monkeypatch.setattr(bpfstats, "node_programs", node)
    monkeypatch.setattr(fdinfo, "scan_bpf_holders", scan)
    return calls, state


def test_series_absent_when_not_wanted(kernel):
    calls, _ = kernel
    c = ProgramStatsCollector(FakeSwitch(None, False), lambda: {"tcp_state": 3}, lambda: "node")
    f = fams(c)
    # misses are counted by the kernel whether statistics are on or not
    assert set(f) == {"nettap_bpf_stats_enabled", "nettap_bpf_stats_source", "nettap_bpf_program_misses"}
    assert samples(f["nettap_bpf_program_misses"]) == {("tcp_state",): 0}
    assert samples(f["nettap_bpf_stats_enabled"]) == {(): 0}
    assert f["nettap_bpf_stats_source"].samples == []
    assert calls == {"own": 1, "node": 0, "scan": 0}          # the misses' one read, no walk


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
    assert (s.btf_id.offset, s.func_info_rec_size.offset, s.func_info.offset, s.nr_func_info.offset) == \
        (128, 132, 136, 144)
    assert ctypes.sizeof(bpfstats.bpf_func_info) == 8 and ctypes.sizeof(bpfstats.btf_type) == 8


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



# ---- full program names from BTF (node_programs against a fake libbpf) ---------

BTF_KIND_FUNC, BTF_KIND_FUNC_PROTO = 12, 13


class FakeBpf:
    """The libbpf calls node_programs and prog_full_name make, answering as
    the kernel does for BPF_OBJ_GET_INFO_BY_FD (the name cut to 15
    characters; func_info copied only when nr_func_info is asked for, with
    EINVAL for a record size other than struct bpf_func_info's) and as
    libbpf does for a program BTF loaded by id.

    progs: id -> (full name, type, btf_id, type_id of func_info[0], nr_func_info);
    btfs: btf_id -> {type_id: (kind, name)}; a btf_id not in btfs fails to load."""

    def __init__(self, progs, btfs):
        self.progs, self.btfs = progs, btfs
        self.fds = {}                    # open fd -> program id
        self.func_info_calls = 0
        self.btf_loads = []
        self.btf_freed = []
        self._types = {}                 # keeps the btf_type structs alive
        self.fail_func_info = set()      # ids whose second info call fails

    # bpf.h
    def bpf_prog_get_next_id(self, cur, ref):
        later = sorted(i for i in self.progs if i > cur)
        if not later:
            return -errno.ENOENT
        ref._obj.value = later[0]
        return 0

    def bpf_prog_get_fd_by_id(self, pid_):
        if pid_ not in self.progs:
            return -errno.ENOENT
        fd = os.open(os.devnull, os.O_RDONLY)
        self.fds[fd] = pid_
        return fd

    def bpf_obj_get_info_by_fd(self, fd, ref, n_ref):
        info = ref._obj
        pid_ = self.fds[fd]
        full, ptype, btf_id, type_id, nr_func_info = self.progs[pid_]
        asked = info.nr_func_info
        if (asked or info.func_info_rec_size) and info.func_info_rec_size != 8:
            return -errno.EINVAL
        if asked and nr_func_info:           # min(asked, nr_func_info) records copied
            self.func_info_calls += 1
            if pid_ in self.fail_func_info:
                return -errno.EFAULT
            fi = bpfstats.bpf_func_info.from_address(info.func_info)
            fi.insn_off, fi.type_id = 0, type_id
        info.id, info.type, info.name = pid_, ptype, full.encode()[:15]
        info.btf_id = btf_id
        info.nr_func_info = nr_func_info
        info.func_info_rec_size = 8
        info.run_cnt, info.run_time_ns = pid_ * 10, pid_ * 1000
        return 0

    # btf.h
    def btf__load_from_kernel_by_id(self, btf_id):
        self.btf_loads.append(btf_id)
        return btf_id if btf_id in self.btfs else None      # a handle, or NULL

    def btf__type_by_id(self, btf, type_id):
        t = self.btfs[btf].get(type_id)
        if t is None:
            return None
        kind, name = t
        st = bpfstats.btf_type(name_off=type_id * 100, info=kind << 24 | 1)
        self._types[(btf, type_id)] = st
        return ctypes.addressof(st)

    def btf__name_by_offset(self, btf, off):
        return self.btfs[btf][off // 100][1].encode()

    def btf__free(self, btf):
        self.btf_freed.append(btf)

    # exporter/kernel/_native.c's walk: (id, the kernel's name, type, run_cnt, run_time_ns)
    def programs(self):
        return [(i, full.encode()[:15], ptype, i * 10, i * 1000)
                for i, (full, ptype, *_rest) in sorted(self.progs.items())]

    # exporter/kernel/_native.c's info calls on nettap's own fds: (run_cnt, run_time_ns, recursion_misses)
    def prog_stats(self, fds):
        return [(self.fds[fd] * 10, self.fds[fd] * 1000, 0) for fd in fds]

    def open_fds(self):
        return [fd for fd in self.fds if is_open(fd)]


# Recorded from nettap's object loaded by exporter.kernel.loader.Probes (tracepoints,
# kernel 6.18): program ids, BTF id, func_info[0].type_id, nr_func_info (the
# exit programs have a subprogram); then the shapes other loaders leave.
NODE = {
    1113: ("tcp_sendmsg_enter", 5, 180, 89, 1),
    1115: ("tcp_sendmsg_enter_iov", 5, 180, 123, 1),
    1116: ("tcp_sendmsg_enter_msg", 5, 180, 127, 1),
    1120: ("tcp_sendmsg_exit", 5, 180, 145, 2),
    1122: ("tcp_state", 5, 180, 197, 1),              # fits: the kernel's name is whole
    1200: ("bench_long_name_no_btf", 1, 0, 0, 0),     # no BTF (bpf_prog_load without one)
    1201: ("tcp_sendmsg_ent_x", 1, 777, 1, 1),        # BTF gone / unreadable
    1202: ("not_a_function_type", 1, 541, 1, 1),      # func_info points at a non-FUNC
    1203: ("type_id_out_of_range", 1, 541, 99, 1),
    1204: ("second_info_call_fails", 1, 541, 2, 1),
    1205: ("btf_but_no_func_info", 1, 541, 0, 0),
}
BTFS = {
    180: {89: (BTF_KIND_FUNC, "tcp_sendmsg_enter"), 123: (BTF_KIND_FUNC, "tcp_sendmsg_enter_iov"),
          127: (BTF_KIND_FUNC, "tcp_sendmsg_enter_msg"), 145: (BTF_KIND_FUNC, "tcp_sendmsg_exit"),
          197: (BTF_KIND_FUNC, "tcp_state")},
    541: {1: (BTF_KIND_FUNC_PROTO, ""), 2: (BTF_KIND_FUNC, "second_info_call_fails")},
}
OURS = (1113, 1115, 1116, 1120, 1122)


@pytest.fixture
def fake_bpf(monkeypatch):
    fake = FakeBpf(dict(NODE), BTFS)
    fake.fail_func_info.add(1204)
    monkeypatch.setattr(bpfstats.libbpf, "lib", lambda: fake)
    monkeypatch.setattr(bpfstats, "_native", fake)
    yield fake
    for fd in fake.open_fds():
        os.close(fd)


def test_node_programs_names_programs_by_their_btf_function(fake_bpf):
    cache = {}
    names = {p[0]: p[1] for p in bpfstats.node_programs(cache)}
    assert names == {
        1113: b"tcp_sendmsg_enter", 1115: b"tcp_sendmsg_enter_iov", 1116: b"tcp_sendmsg_enter_msg",
        1120: b"tcp_sendmsg_exit", 1122: b"tcp_state",
        # every fallback is the kernel's 15 characters, as bpftool shows them
        1200: b"bench_long_name", 1201: b"tcp_sendmsg_ent", 1202: b"not_a_function_",
        1203: b"type_id_out_of_", 1204: b"second_info_cal", 1205: b"btf_but_no_func",
    }
    assert cache == names
    # Names shorter than 15 characters are whole: no BTF read for tcp_state;
    # none either without a btf_id (1200) or func_info (1205), nor when
    # func_info cannot be read (1204).
    assert sorted(fake_bpf.btf_loads) == [180] * 4 + [541, 541, 777]
    assert fake_bpf.func_info_calls == 8
    assert sorted(fake_bpf.btf_freed) == [180] * 4 + [541, 541]      # every BTF loaded is freed
    assert fake_bpf.open_fds() == []                                 # every program fd closed


def test_node_programs_runs_and_types_unchanged(fake_bpf):
    progs = {p[0]: p for p in bpfstats.node_programs({})}
    assert progs[1115] == (1115, b"tcp_sendmsg_enter_iov", 5, 11150, 1115000)


def test_full_names_are_read_once_per_program_id(fake_bpf):
    cache = {}
    bpfstats.node_programs(cache)
    loads, calls = len(fake_bpf.btf_loads), fake_bpf.func_info_calls
    for _ in range(3):
        names = {p[0]: p[1] for p in bpfstats.node_programs(cache)}
    assert (len(fake_bpf.btf_loads), fake_bpf.func_info_calls) == (loads, calls)   # cached
    assert names[1115] == b"tcp_sendmsg_enter_iov"
    del fake_bpf.progs[1115]                                 # unloaded: forgotten
    fake_bpf.progs[1300] = ("tcp_recvmsg_enter_iov", 5, 542, 3, 1)
    fake_bpf.btfs = {**BTFS, 542: {3: (BTF_KIND_FUNC, "tcp_recvmsg_enter_iov")}}
    names = {p[0]: p[1] for p in bpfstats.node_programs(cache)}
    assert 1115 not in names and 1115 not in cache
    assert names[1300] == cache[1300] == b"tcp_recvmsg_enter_iov"
    assert fake_bpf.btf_loads[loads:] == [542]                 # only the new program's BTF


def test_node_programs_uses_the_process_cache_by_default(fake_bpf, monkeypatch):
    monkeypatch.setattr(bpfstats, "_FULL_NAMES", {})
    bpfstats.node_programs()
    loads = len(fake_bpf.btf_loads)
    bpfstats.node_programs()
    assert len(fake_bpf.btf_loads) == loads and bpfstats._FULL_NAMES[1115] == b"tcp_sendmsg_enter_iov"


def test_own_and_node_program_names_join(fake_bpf, monkeypatch):
    """nettap_bpf_program_*{program} (libbpf's names) and the node view's
    program label are the same names, longer than 15 characters included."""
    monkeypatch.setattr(bpfstats, "_FULL_NAMES", {})
    monkeypatch.setattr(fdinfo, "scan_bpf_holders", lambda proc_root="/proc": {
        i: fdinfo.Holder(42, "nettap") for i in OURS})
    own = {NODE[i][0]: fake_bpf.bpf_prog_get_fd_by_id(i) for i in OURS}   # the fds nettap holds
    c = ProgramStatsCollector(FakeSwitch("fd", True), lambda: own, lambda: "node")
    f = fams(c)
    own_names = {s.labels["program"] for s in f["nettap_bpf_program_runs"].samples}
    node_runs = {s.labels["program"]: s.value for s in f["nettap_node_bpf_program_runs"].samples
                 if s.labels["owner"] == "nettap"}
    assert own_names == set(node_runs) == {"tcp_sendmsg_enter", "tcp_sendmsg_enter_iov",
                                           "tcp_sendmsg_enter_msg", "tcp_sendmsg_exit", "tcp_state"}
    assert node_runs["tcp_sendmsg_enter_iov"] == 11150     # no longer summed with the other two
    loads = len(fake_bpf.btf_loads)
    fams(c)
    assert len(fake_bpf.btf_loads) == loads                   # the second scrape reads no BTF


def test_a_refused_walk_gives_no_node_programs_and_says_so_once(monkeypatch, caplog):
    class Refused:
        @staticmethod
        def programs():
            raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(bpfstats, "_native", Refused)
    monkeypatch.setattr(bpfstats, "_WALK_REFUSED", [])
    caplog.set_level("WARNING", logger="exporter.kernel.bpfstats")
    assert bpfstats.node_programs({}) == [] and bpfstats.node_programs({}) == []
    assert [r.getMessage() for r in caplog.records] == [
        "scope node: cannot walk the node's BPF programs: Operation not permitted (it needs CAP_SYS_ADMIN)"]
