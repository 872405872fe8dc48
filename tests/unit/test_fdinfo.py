"""exporter.kernel.fdinfo against a fake /proc (tests/unit/fixtures/proc_bpf) and real fdinfo samples."""
from __future__ import annotations

import builtins
import os
import re
from pathlib import Path

import pytest

from exporter.kernel import fdinfo
from exporter.kernel.fdinfo import (
    PROG_TYPE_NAMES,
    Holder,
    ProgFdinfo,
    iter_bpf_fds,
    parse_fdinfo,
    prog_type_name,
    read_prog_fdinfo,
    scan_bpf_holders,
)

FIXTURES = Path(__file__).parent / "fixtures"
PROC = str(FIXTURES / "proc_bpf")
SAMPLES = FIXTURES / "proc_fdinfo_samples"


def test_parse_fdinfo_real_map_sample():
    assert parse_fdinfo((SAMPLES / "map_hash-6.18").read_text()) == {
        "pos": "0", "flags": "02000002", "mnt_id": "17", "ino": "1039",
        "map_type": "1", "key_size": "4", "value_size": "8", "max_entries": "16",
        "map_flags": "0x0", "map_extra": "0x0", "memlock": "2320", "map_id": "99", "frozen": "0",
    }


def test_read_prog_fdinfo_real_sample():
    info = read_prog_fdinfo(str(SAMPLES / "prog_socket_filter-6.18"))
    assert info == ProgFdinfo(prog_id=69, prog_type=1, run_time_ns=0, run_cnt=0, memlock=4096,
                              prog_jited=True, prog_tag="59f4a931744dcdc6",
                              recursion_misses=0, verified_insns=2)
    assert info.type_name == "socket_filter"


def test_read_prog_fdinfo_old_kernel_fields_absent(tmp_path: Path):
    # 4.19: no run statistics, no recursion_misses, no verified_insns
    p = tmp_path / "fdinfo"
    p.write_text("pos:\t0\nflags:\t02000002\nmnt_id:\t13\nprog_type:\t5\nprog_jited:\t0\n"
                 "prog_tag:\t0123456789abcdef\nmemlock:\t4096\nprog_id:\t12\n")
    info = read_prog_fdinfo(str(p))
    assert (info.prog_id, info.type_name, info.prog_jited) == (12, "tracepoint", False)
    assert info.run_time_ns is info.run_cnt is info.recursion_misses is info.verified_insns is None


def test_read_prog_fdinfo_rejects_maps_and_missing_files():
    with pytest.raises(ValueError):
        read_prog_fdinfo(str(SAMPLES / "map_hash-6.18"))
    with pytest.raises(OSError):
        read_prog_fdinfo(str(SAMPLES / "no-such-file"))


def test_scan_bpf_holders():
    assert scan_bpf_holders(PROC) == {
        7: Holder(1, "systemd"),
        101: Holder(42, "nettap"),  # also held by 200: lowest pid wins
        102: Holder(42, "nettap"),
        103: Holder(200, "bpftool"),  # also held by 1000: pids compare as numbers
        104: Holder(1000, "cilium-agent"),
        106: Holder(500, "linkholder"),  # through a BPF link fd only
    }  # 99 and 150 vanished mid-scan, 160 before it, 300 holds only a map


def test_scan_reads_fdinfo_of_bpf_prog_and_link_fds_only(monkeypatch):
    opened = []
    real_open = builtins.open

    def spy(path, *args, **kwargs):
        opened.append(os.path.relpath(str(path), PROC))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", spy)
    scan_bpf_holders(PROC)
    fdinfos = sorted(p for p in opened if "/fdinfo/" in p)
    assert fdinfos == ["1/fdinfo/42", "1000/fdinfo/10", "1000/fdinfo/11", "1000/fdinfo/9",
                       "150/fdinfo/3", "200/fdinfo/3", "200/fdinfo/4", "42/fdinfo/4",
                       "42/fdinfo/5", "42/fdinfo/7", "500/fdinfo/4", "99/fdinfo/3"]
    # comm once per process that holds a program, and only then
    assert sorted(p for p in opened if p.endswith("comm")) == [
        "1/comm", "1000/comm", "150/comm", "200/comm", "42/comm", "500/comm"]


def test_iter_bpf_fds():
    assert [(fd, target) for fd, target, _ in iter_bpf_fds(PROC, 42)] == [
        (4, fdinfo.BPF_PROG_LINK), (5, fdinfo.BPF_PROG_LINK)]
    assert [fd for fd, _, _ in iter_bpf_fds(PROC, 1000)] == [9, 10, 11]  # numeric order
    assert [fd for fd, _, _ in iter_bpf_fds(PROC, 300, (fdinfo.BPF_MAP_LINK,))] == [3]
    assert list(iter_bpf_fds(PROC, 300)) == []
    assert list(iter_bpf_fds(PROC, 160)) == []  # no fd directory
    assert list(iter_bpf_fds(PROC, 4242)) == []  # no such process


def test_scan_missing_proc_root(tmp_path: Path):
    assert scan_bpf_holders(str(tmp_path / "nope")) == {}


def test_prog_type_names_match_uapi_enum():
    # enum bpf_prog_type as of Linux 6.4+ (BPF_PROG_TYPE_NETFILTER is the last one)
    uapi = """UNSPEC SOCKET_FILTER KPROBE SCHED_CLS SCHED_ACT TRACEPOINT XDP PERF_EVENT
        CGROUP_SKB CGROUP_SOCK LWT_IN LWT_OUT LWT_XMIT SOCK_OPS SK_SKB CGROUP_DEVICE SK_MSG
        RAW_TRACEPOINT CGROUP_SOCK_ADDR LWT_SEG6LOCAL LIRC_MODE2 SK_REUSEPORT FLOW_DISSECTOR
        CGROUP_SYSCTL RAW_TRACEPOINT_WRITABLE CGROUP_SOCKOPT TRACING STRUCT_OPS EXT LSM
        SK_LOOKUP SYSCALL NETFILTER""".split()
    assert PROG_TYPE_NAMES == {i: name.lower() for i, name in enumerate(uapi)}
    assert prog_type_name(99) == "99"


def test_prog_type_names_agree_with_installed_header():
    header = Path("/usr/include/linux/bpf.h")          # linux-libc-dev: scripts/setup.sh test
    assert header.exists(), "no /usr/include/linux/bpf.h: run scripts/setup.sh test"
    body = re.search(r"enum bpf_prog_type \{(.*?)\};", header.read_text(), re.DOTALL)
    assert body is not None
    names = re.findall(r"BPF_PROG_TYPE_(\w+)", body.group(1))
    assert {i: PROG_TYPE_NAMES[i] for i in range(len(names))} == {
        i: n.lower() for i, n in enumerate(names)}


def test_this_machine_does_not_raise():
    for prog_id, holder in scan_bpf_holders().items():
        assert prog_id > 0 and holder.pid > 0
