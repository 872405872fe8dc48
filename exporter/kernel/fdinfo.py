"""Which processes hold which BPF programs, from /proc.

Reads ``<proc_root>/<pid>/fd/<n>`` links: a BPF program fd links to
``anon_inode:bpf-prog``, a BPF link fd to ``anon_inode:bpf_link`` (a map fd to
``anon_inode:bpf-map``). Only for program and link fds is
``<proc_root>/<pid>/fdinfo/<n>`` read, so a scan costs one readlink per fd plus
one small read per program or link fd; ``<proc_root>/<pid>/comm`` is read once
per process that holds a program.

A program fd's fdinfo is printed by bpf_prog_show_fdinfo() in
kernel/bpf/syscall.c::

    pos:	0
    flags:	02000002
    mnt_id:	17
    ino:	1039
    prog_type:	1
    prog_jited:	1
    prog_tag:	59f4a931744dcdc6
    memlock:	4096
    prog_id:	4
    run_time_ns:	0
    run_cnt:	0
    recursion_misses:	0
    verified_insns:	2

run_time_ns and run_cnt appeared in 5.1, recursion_misses in 5.12,
verified_insns in 5.16; they are None on older kernels. The run statistics
only grow while the kernel's BPF stats are on. A map fd's fdinfo
(bpf_map_show_fdinfo) has map_type, key_size, value_size, max_entries,
map_flags (hex), map_extra (hex), memlock, map_id, frozen. A link fd's fdinfo
(bpf_link_show_fdinfo, 5.8+) has link_type, link_id, prog_tag and prog_id.

Processes and fds may vanish at any moment during a scan; those are skipped
silently. Reading other processes' fds needs CAP_SYS_PTRACE (or root).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

BPF_PROG_LINK = "anon_inode:bpf-prog"
BPF_MAP_LINK = "anon_inode:bpf-map"
BPF_LINK_LINK = "anon_inode:bpf_link"  # sic: underscore, unlike the other two

# enum bpf_prog_type, include/uapi/linux/bpf.h: BPF_PROG_TYPE_<NAME>, lowercased.
PROG_TYPE_NAMES: Dict[int, str] = {
    0: "unspec",
    1: "socket_filter",
    2: "kprobe",
    3: "sched_cls",
    4: "sched_act",
    5: "tracepoint",
    6: "xdp",
    7: "perf_event",
    8: "cgroup_skb",
    9: "cgroup_sock",
    10: "lwt_in",
    11: "lwt_out",
    12: "lwt_xmit",
    13: "sock_ops",
    14: "sk_skb",
    15: "cgroup_device",
    16: "sk_msg",
    17: "raw_tracepoint",
    18: "cgroup_sock_addr",
    19: "lwt_seg6local",
    20: "lirc_mode2",
    21: "sk_reuseport",
    22: "flow_dissector",
    23: "cgroup_sysctl",
    24: "raw_tracepoint_writable",
    25: "cgroup_sockopt",
    26: "tracing",
    27: "struct_ops",
    28: "ext",
    29: "lsm",
    30: "sk_lookup",
    31: "syscall",
    32: "netfilter",
}


def prog_type_name(prog_type: int) -> str:
    """The kernel's name for a program type; the number for types newer than this table."""
    return PROG_TYPE_NAMES.get(prog_type, str(prog_type))


@dataclass(frozen=True)
class Holder:
    """A process holding a BPF program fd."""

    pid: int
    comm: str


@dataclass(frozen=True)
class ProgFdinfo:
    """The fields of a BPF program fd's fdinfo (see the module docstring)."""

    prog_id: int
    prog_type: int
    run_time_ns: Optional[int]  # None before 5.1
    run_cnt: Optional[int]  # None before 5.1
    memlock: int
    prog_jited: bool = False
    prog_tag: str = ""
    recursion_misses: Optional[int] = None  # None before 5.12
    verified_insns: Optional[int] = None  # None before 5.16

    @property
    def type_name(self) -> str:
        return prog_type_name(self.prog_type)


def parse_fdinfo(text: str) -> Dict[str, str]:
    """Parses fdinfo "key:<tab>value" lines into {key: value}, values as text."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _optional_int(fields: Dict[str, str], key: str) -> Optional[int]:
    value = fields.get(key)
    return int(value) if value is not None else None


def prog_fdinfo_from(fields: Dict[str, str]) -> ProgFdinfo:
    """Builds a ProgFdinfo from parsed fdinfo; ValueError if it is not a program's."""
    try:
        return ProgFdinfo(
            prog_id=int(fields["prog_id"]),
            prog_type=int(fields["prog_type"]),
            prog_jited=fields.get("prog_jited", "0") == "1",
            prog_tag=fields.get("prog_tag", ""),
            memlock=int(fields.get("memlock", "0")),
            run_time_ns=_optional_int(fields, "run_time_ns"),
            run_cnt=_optional_int(fields, "run_cnt"),
            recursion_misses=_optional_int(fields, "recursion_misses"),
            verified_insns=_optional_int(fields, "verified_insns"),
        )
    except KeyError as e:
        raise ValueError(f"not a BPF program fdinfo: no {e.args[0]}") from None


def read_prog_fdinfo(path: str) -> ProgFdinfo:
    """Reads one program fd's fdinfo file, e.g. /proc/PID/fdinfo/N.

    Raises OSError if it cannot be read (the fd or process is gone) and
    ValueError if it is not a BPF program's fdinfo.
    """
    with open(path, encoding="ascii", errors="replace") as f:
        return prog_fdinfo_from(parse_fdinfo(f.read()))


def _pids(proc_root: str) -> Iterator[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return iter(())
    return iter(sorted(int(n) for n in names if n.isdigit()))


def _read_comm(proc_root: str, pid: int) -> Optional[str]:
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), encoding="utf-8",
                  errors="replace") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def iter_bpf_fds(proc_root: str, pid: int, links: Tuple[str, ...] = (BPF_PROG_LINK,)
                 ) -> Iterator[Tuple[int, str, str]]:
    """(fd number, link target, fdinfo path) of the process's fds whose target is in ``links``.

    In fd order. Yields nothing when the process is gone or its fds cannot be read.
    """
    fd_dir = os.path.join(proc_root, str(pid), "fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # vanished, or not ours to look at
        return
    for name in sorted((n for n in fds if n.isdigit()), key=int):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # fd closed (or process exited) since the listing
            continue
        if target in links:
            yield int(name), target, os.path.join(proc_root, str(pid), "fdinfo", name)


def scan_bpf_holders(proc_root: str = "/proc") -> Dict[int, Holder]:
    """{prog_id: Holder} for every BPF program some process holds open.

    A process holds a program through a program fd or a BPF link fd. A program
    held by several processes is credited to the lowest pid. Programs kept
    loaded only by a pin or an attachment without a link fd have no holder.
    Processes, fds and fdinfo files that vanish mid-scan are skipped.
    """
    holders: Dict[int, Holder] = {}
    for pid in _pids(proc_root):
        comm: Optional[str] = None
        for _, _, fdinfo_path in iter_bpf_fds(proc_root, pid, (BPF_PROG_LINK, BPF_LINK_LINK)):
            try:
                with open(fdinfo_path, encoding="ascii", errors="replace") as f:
                    prog_id = int(parse_fdinfo(f.read())["prog_id"])
            except (OSError, KeyError, ValueError):
                continue
            if prog_id in holders:
                continue
            if comm is None:
                comm = _read_comm(proc_root, pid)
                if comm is None:  # exited between reading its fds and its comm
                    break
            holders[prog_id] = Holder(pid, comm)
    return holders
