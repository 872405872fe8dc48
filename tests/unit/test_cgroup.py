"""exporter.metrics.cgroup against fake cgroup trees (tests/unit/fixtures/cgroup_*); no root."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, Tuple

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.metrics import cgroup
from exporter.metrics.cgroup import CgroupCollector, locate_cgroup, read_cgroup_stats

FIXTURES = Path(__file__).parent / "fixtures"
P = "nettap_cgroup_"


def roots(tree: Path) -> Tuple[str, str]:
    return str(tree / "proc"), str(tree / "sys" / "fs" / "cgroup")


def stats(tree: Path) -> Dict[str, float]:
    return read_cgroup_stats(*roots(tree))


def expect(**values) -> Dict[str, float]:
    """The stats a tree should read: nettap_cgroup_<name> for each name given."""
    return {P + name: v for name, v in values.items()}


@pytest.fixture
def copy(tmp_path: Path):
    """Copies a fixture tree into tmp_path so a test can break it."""
    def _copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst)
        return dst
    return _copy


def scrape(tree: Path) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one collect()."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in CgroupCollector(*roots(tree)).collect() for s in fam.samples}


def test_pure_v2():
    assert stats(FIXTURES / "cgroup_v2") == expect(
        cpu_periods_total=1200, cpu_throttled_periods_total=34, cpu_throttled_seconds_total=1.5,
        memory_usage_bytes=52428800, memory_limit_bytes=268435456, memory_oom_events_total=3,
        memory_oom_kills_total=2)
    loc = locate_cgroup(*roots(FIXTURES / "cgroup_v2"))
    assert loc.cpu == loc.memory
    assert loc.cpu is not None and loc.cpu.version == "2"
    assert loc.info() == [("2", "/system.slice/nettap.service")]


def test_hybrid_uses_v1_when_unified_has_no_controllers():
    # The unified cgroup has a cpu.stat, but only usage fields: no cpu controller there.
    # limit: v1 "unlimited" value -> absent; oom events: no v1 counter -> absent
    assert stats(FIXTURES / "cgroup_hybrid") == expect(
        cpu_periods_total=500, cpu_throttled_periods_total=7, cpu_throttled_seconds_total=2.5,
        memory_usage_bytes=3145728, memory_oom_kills_total=1)
    loc = locate_cgroup(*roots(FIXTURES / "cgroup_hybrid"))
    assert loc.cpu is not None and loc.memory is not None
    assert loc.cpu.directory.endswith("/cpu/system.slice/nettap.service")
    assert loc.info() == [("1", "/system.slice/nettap.service")]


def test_pure_v1_combined_cpu_cpuacct_in_container():
    # Mount root /docker/<id> is the container's cgroup: its files are at the mount point.
    # oom_control without oom_kill (kernel < 4.13) -> oom kills absent
    assert stats(FIXTURES / "cgroup_v1") == expect(
        cpu_periods_total=100, cpu_throttled_periods_total=10, cpu_throttled_seconds_total=0.123456789,
        memory_usage_bytes=104857600, memory_limit_bytes=536870912)


def test_throttled_time_converted_exactly(copy):
    v2, v1 = copy("cgroup_v2"), copy("cgroup_v1")
    (v2 / "sys/fs/cgroup/system.slice/nettap.service/cpu.stat").write_text(
        "nr_periods 1\nnr_throttled 1\nthrottled_usec 1234567\n")
    (v1 / "sys/fs/cgroup/cpu,cpuacct/cpu.stat").write_text(
        "nr_periods 1\nnr_throttled 1\nthrottled_time 7000000001\n")
    assert stats(v2)[P + "cpu_throttled_seconds_total"] == 1.234567
    assert stats(v1)[P + "cpu_throttled_seconds_total"] == 7.000000001


def test_v2_unlimited_memory_has_no_limit_series(copy):
    tree = copy("cgroup_v2")
    (tree / "sys/fs/cgroup/system.slice/nettap.service/memory.max").write_text("max\n")
    got = stats(tree)
    assert P + "memory_limit_bytes" not in got
    assert got[P + "memory_usage_bytes"] == 52428800


@pytest.mark.parametrize("value", ["9223372036854771712", "9223372036854710272",
                                   "18446744073709551615"])
def test_v1_unlimited_values(copy, value):
    # 4 KiB pages, 64 KiB pages, pre-3.19 res_counter RESOURCE_MAX
    tree = copy("cgroup_v1")
    (tree / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(value + "\n")
    assert P + "memory_limit_bytes" not in stats(tree)


def test_v2_cpu_controller_not_enabled(copy):
    tree = copy("cgroup_v2")
    (tree / "sys/fs/cgroup/system.slice/nettap.service/cpu.stat").write_text(
        "usage_usec 10\nuser_usec 5\nsystem_usec 5\n")
    got = stats(tree)
    assert not any(k.startswith(P + "cpu_") for k in got)
    assert got[P + "memory_usage_bytes"] == 52428800


def test_missing_files_and_controllers_are_absent(copy):
    v2 = copy("cgroup_v2")
    os.remove(v2 / "sys/fs/cgroup/system.slice/nettap.service/memory.events")
    got = stats(v2)
    assert P + "memory_oom_events_total" not in got and P + "memory_oom_kills_total" not in got
    assert got[P + "memory_limit_bytes"] == 268435456

    v1 = copy("cgroup_v1")
    shutil.rmtree(v1 / "sys/fs/cgroup/memory")  # controller gone: files unreadable
    assert sorted(stats(v1)) == [P + "cpu_periods_total", P + "cpu_throttled_periods_total",
                                 P + "cpu_throttled_seconds_total"]

    (v1 / "proc/self/cgroup").write_text("11:memory:/x\n0::/\n")  # no cpu line at all
    assert P + "cpu_periods_total" not in stats(v1)


def test_read_errors_do_not_raise(copy):
    tree = copy("cgroup_v2")
    cg = tree / "sys/fs/cgroup/system.slice/nettap.service"
    os.remove(cg / "memory.current")
    (cg / "memory.current").mkdir()  # open() -> IsADirectoryError
    (cg / "memory.max").write_text("garbage\n")
    got = stats(tree)
    assert P + "memory_usage_bytes" not in got and P + "memory_limit_bytes" not in got
    assert got[P + "memory_oom_kills_total"] == 2

    os.remove(tree / "proc/self/cgroup")
    assert stats(tree) == {}
    assert scrape(tree) == {}


@pytest.mark.parametrize("name", ["cgroup_v2", "cgroup_hybrid"])
def test_without_mountinfo_conventional_paths(copy, name):
    tree = copy(name)
    want = stats(tree)
    os.remove(tree / "proc/self/mountinfo")
    assert stats(tree) == want


def test_collect_exposition_hybrid():
    got = scrape(FIXTURES / "cgroup_hybrid")
    assert got[(P + "info", (("path", "/system.slice/nettap.service"), ("version", "1")))] == 1
    assert got[(P + "cpu_throttled_seconds_total", ())] == 2.5
    assert not any(name == P + "memory_limit_bytes" for name, _ in got)
    reg = CollectorRegistry()
    reg.register(CgroupCollector(*roots(FIXTURES / "cgroup_hybrid")))
    text = generate_latest(reg).decode()
    assert "# TYPE nettap_cgroup_cpu_periods_total counter" in text
    assert "nettap_cgroup_memory_usage_bytes 3.145728e+06" in text
    assert "memory_limit_bytes" not in text


def test_describe_reads_nothing(monkeypatch):
    def boom(path: str) -> str:
        raise AssertionError(f"describe() read {path}")
    monkeypatch.setattr(cgroup, "_read", boom)
    names = {f.name for f in CgroupCollector("/nonexistent", "/nonexistent").describe()}
    # families are named without the _total suffix of their counter samples
    assert names == {n.removesuffix("_total") for n, _, _ in cgroup.METRICS} | {P + "info"}


def test_mountinfo_octal_escapes(tmp_path: Path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/a b\n")
    (tmp_path / "proc/self/mountinfo").write_text(
        "25 24 0:23 / /sys/fs/cgroup/my\\040root rw - cgroup2 cgroup2 rw\n")
    cg = tmp_path / "cg" / "my root" / "a b"
    cg.mkdir(parents=True)
    (cg / "memory.current").write_text("4096\n")
    assert read_cgroup_stats(str(tmp_path / "proc"), str(tmp_path / "cg")) == {
        P + "memory_usage_bytes": 4096}


def test_hierarchy_mounted_twice_prefers_cgroup_root(copy):
    tree = copy("cgroup_v2")
    mi = tree / "proc/self/mountinfo"
    mi.write_text("90 22 0:23 / /run/other rw - cgroup2 cgroup2 rw\n" + mi.read_text())
    assert stats(tree) == stats(FIXTURES / "cgroup_v2")  # mounts outside cgroup_root unused
    # with the real root, mounts elsewhere are usable but those under /sys/fs/cgroup win
    mounts = cgroup._parse_mountinfo(
        "90 22 0:23 / /run/other rw - cgroup2 cgroup2 rw\n"
        "25 24 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", "/sys/fs/cgroup")
    chosen = cgroup._pick(mounts, "/sys/fs/cgroup")
    assert chosen is not None and chosen.mountpoint == "/sys/fs/cgroup"
    assert cgroup._pick(mounts[:1], "/sys/fs/cgroup") == mounts[0]


def test_this_machine_does_not_raise():
    fams = list(CgroupCollector().collect())
    assert all(f.name.startswith(P) for f in fams)
