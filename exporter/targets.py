"""Capture targets: from config items to entries of the kernel's filter maps.

:func:`resolve` checks that each target exists and turns it into what the
BPF programs compare against: a tgid, a cgroup v2 id and level, a network
namespace inode, a port bit. :class:`TargetMaps` writes a resolved set into
the maps of a loaded object, changing only what differs, so captures change
at run time without reloading any program.
"""
from __future__ import annotations

import fcntl
import os
import re
import struct

from . import maps
from .config import ConfigError
from .tcp_h import MAX_CGROUP_LEVEL, MAX_CGROUP_LEVELS, TARGET_CGROUP, TARGET_NETNS, TARGET_PID, TARGET_PORT


class Resolved:
    """What the programs compare against (a plain class: no dataclasses import
    on the path to attaching the probes)."""

    def __init__(self, pids=None, cgroups=None, netns=None, ports=None):
        self.pids = set(pids or ())
        self.cgroups = dict(cgroups or {})          # cgroup id -> level
        self.netns = set(netns or ())
        self.ports = set(ports or ())

    def __eq__(self, other) -> bool:
        return isinstance(other, Resolved) and (self.pids, self.cgroups, self.netns, self.ports) == \
            (other.pids, other.cgroups, other.netns, other.ports)

    def __repr__(self) -> str:
        return f"Resolved(pids={self.pids}, cgroups={self.cgroups}, netns={self.netns}, ports={self.ports})"

    @property
    def flags(self) -> int:
        return ((TARGET_PID if self.pids else 0) | (TARGET_CGROUP if self.cgroups else 0)
                | (TARGET_NETNS if self.netns else 0) | (TARGET_PORT if self.ports else 0))

    @property
    def cgroup_levels(self) -> int:
        m = 0
        for lvl in self.cgroups.values():
            m |= 1 << lvl
        return m


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup2_mounts(mountinfo: str = "/proc/self/mountinfo") -> list:
    """(mount point, root within the hierarchy) of every cgroup2 mount."""
    out = []
    with open(mountinfo) as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            if post.split()[:1] == ["cgroup2"]:
                out.append((_unescape(fields[4]), _unescape(fields[3])))
    return out


def cgroup_id_level(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple:
    """A cgroup v2 directory's id (its kernfs inode) and level (root = 0)."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ConfigError(f"cgroup {path}: no such cgroup directory")
    best = None
    for mnt, root in cgroup2_mounts(mountinfo):
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best[0])):
            best = (mnt, root)
    if best is None:
        raise ConfigError(f"cgroup {path}: not on a cgroup v2 hierarchy (a cgroup v1 path?); "
                          "nettap matches cgroup v2 ids")
    mnt, root = best
    rel = [p for p in os.path.relpath(real, mnt).split(os.sep) if p not in ("", ".")]
    level = len([p for p in root.split("/") if p]) + len(rel)
    if level > MAX_CGROUP_LEVEL:
        raise ConfigError(f"cgroup {path}: level {level} is deeper than {MAX_CGROUP_LEVEL}")
    return os.stat(real).st_ino, level


NS_GET_NSTYPE = 0xB703        # ioctl on a namespace fd (linux/nsfs.h)
CLONE_NEWNET = 0x40000000


def _netns_held(ino: int, proc: str) -> bool:
    """Whether a process (its /proc/PID/ns/net) or an nsfs bind mount (ip
    netns add's /run/netns/NAME, a runtime's own) has network namespace ino."""
    want = f"net:[{ino}]"
    try:
        with open(f"{proc}/self/mountinfo") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fields = pre.split()
                if post.split()[:1] == ["nsfs"] and len(fields) > 3 and fields[3] == want:
                    return True
    except OSError:
        pass
    for pid in os.listdir(proc):
        if pid.isdigit():
            try:
                if os.readlink(f"{proc}/{pid}/ns/net") == want:
                    return True
            except OSError:                     # gone meanwhile, or not ours to read
                pass
    return False


def netns_inode(value, proc: str = "/proc") -> int:
    """A network namespace's inode, from a path like /var/run/netns/NAME or
    an inode that a process or a bind mount has (else ConfigError)."""
    if isinstance(value, int):
        if not _netns_held(value, proc):
            raise ConfigError(f"netns {value}: no such network namespace (no process in {proc} and no "
                              "nsfs bind mount, e.g. under /run/netns, has it)")
        return value
    try:
        fd = os.open(value, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)   # a FIFO must not block
    except OSError as e:
        raise ConfigError(f"netns {value}: {e.strerror}") from None
    try:
        try:
            kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            raise ConfigError(f"netns {value}: not a namespace file (expected e.g. /var/run/netns/NAME)") from None
        if kind != CLONE_NEWNET:
            raise ConfigError(f"netns {value}: a namespace, but not a network namespace")
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _tgid(proc: str, pid: int) -> int | None:
    """The thread group of pid (itself for a process, its process for a thread)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resolve(targets: list, proc: str = "/proc") -> Resolved:
    r = Resolved()
    for i, t in enumerate(targets):
        try:
            if t.kind == "port":
                r.ports.add(t.value)
            elif t.kind == "pid":
                if _tgid(proc, t.value) != t.value:
                    raise ConfigError(f"pid {t.value}: no such process (a thread id is not a pid)")
                r.pids.add(t.value)
            elif t.kind == "cgroup":
                cid, lvl = cgroup_id_level(t.value)
                r.cgroups[cid] = lvl
            elif t.kind == "netns":
                r.netns.add(netns_inode(t.value, proc))
        except ConfigError as e:
            raise ConfigError(f"captures[{i}].{t.kind}: {e}") from None
    levels = sorted(set(r.cgroups.values()))
    if len(levels) > MAX_CGROUP_LEVELS:
        raise ConfigError(f"captures: cgroup targets sit at {len(levels)} different levels {levels}; "
                          f"at most {MAX_CGROUP_LEVELS} are matched in the kernel")
    return r


def _u32(v: int) -> bytes:
    return v.to_bytes(4, "little")


def _u64(v: int) -> bytes:
    return v.to_bytes(8, "little")


# Each ring wakes its reader once this fraction of its own size is pending
# (before, capture_eof was given capture_chunks' threshold, which its small
# ring never reached: it was drained only on the poll timeout). A quarter
# leaves three quarters of the ring for the time the drain takes to run.
WAKEUP_FRACTION = 4


def wakeup_thresholds(ring_bytes: dict) -> dict:
    """ring -> wakeup threshold in bytes, for the rings that have one."""
    return {r: ring_bytes[r] // WAKEUP_FRACTION for r in ("capture_chunks", "capture_eof")}


class TargetMaps:
    """The filter maps of one loaded object. Not thread-safe: one writer."""

    def __init__(self, map_fds: dict):
        self.fds = map_fds
        self.current = Resolved()
        self._bitmap = [0] * 1024

    def apply(self, new: Resolved, max_payload_bytes: int, wakeup_bytes: dict) -> None:
        """Add new entries, then switch capture_config, then remove stale
        entries, so no call is missed while targets change. wakeup_bytes:
        ring -> its wakeup threshold (capture_chunks, capture_eof), as
        :func:`wakeup_thresholds` gives them."""
        old = self.current
        for pid in new.pids - old.pids:
            maps.update(self.fds["capture_pids"], _u32(pid), b"\1")
        for cid in new.cgroups.keys() - old.cgroups.keys():
            maps.update(self.fds["capture_cgroups"], _u64(cid), b"\1")
        for ino in new.netns - old.netns:
            maps.update(self.fds["capture_netns"], _u32(ino), b"\1")
        bitmap = [0] * 1024
        for p in new.ports:
            bitmap[p >> 6] |= 1 << (p & 63)
        for word, (bits, was) in enumerate(zip(bitmap, self._bitmap)):
            if bits != was:
                maps.update(self.fds["capture_ports"], _u32(word), _u64(bits))
        # struct nettap_capture_config: flags, cgroup_levels, max_payload_bytes,
        # wakeup_bytes (capture_chunks), eof_wakeup_bytes (capture_eof), pad0
        cfg = struct.pack("<IIIIII", new.flags, new.cgroup_levels, max_payload_bytes,
                          wakeup_bytes["capture_chunks"], wakeup_bytes["capture_eof"], 0)
        maps.update(self.fds["capture_config"], _u32(0), cfg)
        for pid in old.pids - new.pids:
            maps.delete(self.fds["capture_pids"], _u32(pid))
        for cid in old.cgroups.keys() - new.cgroups.keys():
            maps.delete(self.fds["capture_cgroups"], _u64(cid))
        for ino in old.netns - new.netns:
            maps.delete(self.fds["capture_netns"], _u32(ino))
        self._bitmap = bitmap
        self.current = new
