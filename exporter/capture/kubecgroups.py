"""The kubelet's cgroups on this node: cgroup id -> the pod and container.

:func:`scan` walks only the kubelet's part of the cgroup v2 hierarchy
(``kubepods.slice`` or ``kubepods`` at most two levels below the root: a
kubelet may have a root of its own, as kind's ``kubelet.slice``), three
levels deep (QoS class, pod, container), and names each directory by
:func:`exporter.capture.kubepath.parse`. A cgroup's id is its directory's
inode number (kernfs), what the BPF programs' bpf_get_current_cgroup_id
and the owner record's cgroup_id give, so a lookup is one dict access.
"""
from __future__ import annotations

import os
import time
from collections import namedtuple

from exporter.capture.kubepath import Identity, is_kubepods, parse

MAX_CGROUPS = 1 << 16            # a node runs at most a few hundred pods (kubelet's maxPods: 110 by default)
MAX_PROCS = 1 << 14              # processes whose pod is remembered on a cgroup v1 node (then forgotten at once)


class Cgroup(namedtuple("Cgroup", "identity level path")):
    """identity: a kubepath.Identity; level: in the whole hierarchy (root 0),
    as the filter compares it; path: the directory."""

    __slots__ = ()


def _dirs(path: str):
    """(name, path, inode) of the directories in path (none if it is gone)."""
    try:
        with os.scandir(path) as it:
            return [(e.name, e.path, e.inode()) for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def kubepods_dirs(root: str) -> list:
    """(path, depth) of the kubelet's top cgroups: kubepods at most two levels
    below root (a kubelet's --cgroup-root: kind's kubelet.slice, /k8s)."""
    out = []
    for name, path, _ in _dirs(root):
        if is_kubepods(name):
            out.append((path, 1))
        else:
            out += [(p, 2) for n, p, _ in _dirs(path) if is_kubepods(n)]
    return out


def scan(root: str, root_level: int = 0) -> dict:
    """cgroup id -> :class:`Cgroup` of every pod's and container's cgroup
    below root (whose own level is root_level), at most MAX_CGROUPS."""
    out: dict = {}
    for top, depth in kubepods_dirs(root):
        stack = [(top, depth, 0)]
        while stack and len(out) < MAX_CGROUPS:
            path, level, below = stack.pop()
            for _, sub, ino in _dirs(path):
                ident = parse(sub)
                if ident is not None:
                    out[ino] = Cgroup(ident, root_level + level + 1, sub)
                # QoS class -> pod -> container; nothing below a container is another's
                if below < 2 and (ident is None or not ident.container_id):
                    stack.append((sub, level + 1, below + 1))
    return out


def pod_cgroups(cgroups: dict) -> dict:
    """pod UID -> {cgroup id: Cgroup} of its own cgroup and its containers'."""
    out: dict = {}
    for cid, cg in cgroups.items():
        out.setdefault(cg.identity.pod_uid, {})[cid] = cg
    return out


def proc_identity(proc: str, pid: int) -> Identity | None:
    """A process's pod and container from /proc/PID/cgroup (cgroup v1 nodes,
    where the v2 id the programs read names no pod); None if it is gone."""
    from exporter.capture.kubepath import from_proc_cgroup
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            return from_proc_cgroup(f.read(1 << 16))
    except (OSError, UnicodeDecodeError):
        return None


class Processes:
    """Processes' pods on a cgroup v1 node (proc_identity), remembered by
    (pid, start time): a pid reused after its process exited is another
    process, looked up again. Used by the drain thread only."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        self._known: dict = {}           # (pid, start time) -> Identity or None

    def identity(self, pid: int, ts_ns: int = 0) -> Identity | None:
        """Process pid's pod and container, or None: gone, no pod's, or it
        started after ts_ns (a record's CLOCK_MONOTONIC time: then the pid
        was reused, and the record is another process's). The start time is
        in CLOCK_BOOTTIME ticks (proc(5) stat field 22); the record's time is
        moved to that clock by the time suspended until now, so a suspend
        between the record and this lookup can still attribute a process
        started in that window."""
        from exporter.capture.targets import start_time
        start = start_time(self.proc, pid)
        if start is None:
            return None
        if ts_ns and start * self.tick_ns > ts_ns + _suspended_ns():
            return None
        key = (pid, start)
        try:
            return self._known[key]
        except KeyError:
            pass
        ident = proc_identity(self.proc, pid)
        if start_time(self.proc, pid) != start:      # exited meanwhile: that file may be another's
            return None
        if len(self._known) >= MAX_PROCS:
            self._known.clear()
        self._known[key] = ident
        return ident


def _suspended_ns() -> int:
    """CLOCK_BOOTTIME - CLOCK_MONOTONIC: the time this machine was suspended."""
    mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)           # first: never a negative difference
    return max(time.clock_gettime_ns(time.CLOCK_BOOTTIME) - mono, 0)
