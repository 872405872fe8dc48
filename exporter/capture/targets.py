"""Capture targets: from config items to what the kernel's filter compares.

:func:`resolve` checks that each target exists and turns it into what the
BPF programs compare against: a tgid, a cgroup v2 id and level, a network
namespace inode, a port bit (a :class:`Resolved` set). A pid target is the
process that had the pid when the target was first applied (its start
time, /proc/PID/stat field 22), and a cgroup target the cgroup at its path
then. exporter/capture/filter.py writes a resolved set into the kernel's
maps and watches for targets that go away.
"""
from __future__ import annotations

import fcntl
import logging
import os

from exporter.util.mounts import read as read_mountinfo
from exporter.config import ConfigError
from exporter.kernel.tcp_h import (KIND_SEGMENT, MAX_CGROUP_LEVEL, MAX_CGROUP_LEVELS, NAMES, TARGET_CGROUP,
                                   TARGET_NETNS, TARGET_PID, TARGET_PORT, TARGET_SEGMENTS)

log = logging.getLogger(__name__)

# The hash maps holding each kind of target (bpf/maps.bpf.h), and the kind's name.
TARGET_MAPS = (("pids", "capture_pids", "pid"), ("cgroups", "capture_cgroups", "cgroup"),
               ("netns", "capture_netns", "netns"), ("ports", "capture_port_kinds", "port"))
_KIND_NUMBERS = {name: n for n, name in NAMES["KIND"].items()}


def kind_bits(kinds) -> int:
    """bit (1 << NETTAP_KIND_*) of each record kind named (capture_config.records,
    a target entry's value, conn.wants)."""
    return sum(1 << _KIND_NUMBERS[k] for k in set(kinds))


class Resolved:
    """What the programs compare against (a plain class: no dataclasses import
    on the path to attaching the probes)."""

    def __init__(self, pids=None, cgroups=None, netns=None, ports=None, pid_starts=None,
                 cgroup_paths=None, gone=None, kinds=None, matched=None):
        self.pids = set(pids or ())
        self.cgroups = dict(cgroups or {})          # cgroup id -> level
        self.netns = set(netns or ())
        self.ports = set(ports or ())
        # (kind, pid | cgroup id | netns inode | port) of those above -> the
        # record kinds its sockets publish (kind_bits; absent: none asked)
        self.kinds = dict(kinds or {})
        # Identity: pid -> its process's start time (clock ticks after boot),
        # config path -> cgroup id; and the (kind, value) targets the config
        # lists whose process exited or cgroup was removed (not in the maps).
        self.pid_starts = dict(pid_starts or {})
        self.cgroup_paths = dict(cgroup_paths or {})
        self.gone = set(gone or ())
        # kubernetes targets: the target (its text) -> the cgroup ids it matched (exporter/capture/kube.py)
        self.matched = dict(matched or {})
        # the same without the kubernetes targets' cgroups (with_kubernetes), or None
        self.base: Resolved | None = None

    def without(self, gone) -> "Resolved":
        """A copy with the gone (kind, value) targets taken out of the maps' sets."""
        pids = {v for k, v in gone if k == "pid"}
        paths = {v for k, v in gone if k == "cgroup"}
        ids = {self.cgroup_paths[p] for p in paths if p in self.cgroup_paths}
        keep_paths = {p: c for p, c in self.cgroup_paths.items() if p not in paths}
        ids -= set(keep_paths.values())          # another listed path names the same cgroup
        kinds = {(k, v): m for (k, v), m in self.kinds.items()
                 if not (k == "pid" and v in pids or k == "cgroup" and v in ids)}
        out = Resolved(self.pids - pids, {c: l for c, l in self.cgroups.items() if c not in ids},
                       self.netns, self.ports, {p: t for p, t in self.pid_starts.items() if p not in pids},
                       keep_paths, self.gone | set(gone), kinds, self.matched)
        out.base = self.base.without(gone) if self.base is not None else None
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, Resolved) and (self.pids, self.cgroups, self.netns, self.ports, self.kinds) == \
            (other.pids, other.cgroups, other.netns, other.ports, other.kinds)

    def __repr__(self) -> str:
        return (f"Resolved(pids={self.pids}, cgroups={self.cgroups}, netns={self.netns}, ports={self.ports}"
                + (f", kinds={dict(sorted(self.kinds.items(), key=str))}" if self.kinds else "")
                + (f", gone={self.gone}" if self.gone else "") + ")")

    @property
    def flags(self) -> int:
        return ((TARGET_PID if self.pids else 0) | (TARGET_CGROUP if self.cgroups else 0)
                | (TARGET_NETNS if self.netns else 0) | (TARGET_PORT if self.ports else 0)
                | (TARGET_SEGMENTS if any(m >> KIND_SEGMENT & 1 for m in self.kinds.values()) else 0))

    @property
    def cgroup_levels(self) -> int:
        m = 0
        for lvl in self.cgroups.values():
            m |= 1 << lvl
        return m


def cgroup2_mounts(mountinfo: str = "/proc/self/mountinfo") -> list:
    """(mount point, root within the hierarchy) of every cgroup2 mount."""
    return [(m.mountpoint, m.root) for m in read_mountinfo(mountinfo) if m.fstype == "cgroup2"]


# PROC_CGROUP_INIT_INO (include/linux/proc_ns.h): the inode of the initial
# cgroup namespace, where mountinfo shows cgroup paths from the hierarchy's root.
CGROUP_NS_INIT_INO = 0xEFFFFFFB


def in_initial_cgroup_ns(ns: str = "/proc/self/ns/cgroup") -> bool:
    try:
        return os.stat(ns).st_ino == CGROUP_NS_INIT_INO
    except OSError:                  # a kernel without cgroup namespaces: paths are global
        return True


def _ns_root_level(mounts: list) -> int | None:
    """The level of this process's cgroup namespace root, or None if no
    mount tells. mountinfo shows a cgroup2 mount's root relative to that
    namespace root (cgroup_show_path, kernel/cgroup/cgroup.c), so the
    hierarchy's own root shows as "/.." once per level; only that root
    lacks cgroup.events (CFTYPE_NOT_ON_ROOT), which tells it apart."""
    for mnt, root in mounts:
        parts = [p for p in root.split("/") if p]
        if all(p == ".." for p in parts) and os.path.isdir(mnt) \
                and not os.path.exists(os.path.join(mnt, "cgroup.events")):
            return len(parts)
    return None


def cgroup_id_level(path: str, mountinfo: str = "/proc/self/mountinfo", initial_ns: bool | None = None) -> tuple:
    """A cgroup v2 directory's id (its kernfs inode, the same in every
    namespace) and its level in the whole hierarchy (root = 0), which the
    programs compare the current task's ancestors at. initial_ns: whether
    this process is in the initial cgroup namespace (default: ask the kernel)."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ConfigError(f"cgroup {path}: no such cgroup directory")
    mounts = cgroup2_mounts(mountinfo)
    best = None
    for mnt, root in mounts:
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best[0])):
            best = (mnt, root)
    if best is None:
        raise ConfigError(f"cgroup {path}: not on a cgroup v2 hierarchy (a cgroup v1 path?); "
                          "nettap matches cgroup v2 ids")
    mnt, root = best
    rel = [p for p in os.path.relpath(real, mnt).split(os.sep) if p not in ("", ".")]
    parts = [p for p in root.split("/") if p]
    up = len(parts) - len([p for p in parts if p != ".."])
    if initial_ns is None:
        initial_ns = in_initial_cgroup_ns()
    if initial_ns:
        base = 0                     # mount roots are paths from the hierarchy's root
    else:
        # In a private cgroup namespace (every Kubernetes pod) mount roots
        # are relative to the namespace's root, whose own level is hidden.
        base = _ns_root_level(mounts)
        if base is None:
            raise ConfigError(f"cgroup {path}: nettap runs in a private cgroup namespace and no cgroup2 mount "
                              "shows the hierarchy's root, so the cgroup's level is unknown; mount the host's "
                              "cgroup2 root (as deploy/kubernetes does at /host/sys/fs/cgroup)")
    level = base - up + len(parts) - up + len(rel)
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
        if any(m.fstype == "nsfs" and m.root == want for m in read_mountinfo(f"{proc}/self/mountinfo")):
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


def tgid(proc: str, pid: int) -> int | None:
    """The thread group of pid (itself for a process, its process for a thread)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def start_time(proc: str, pid: int) -> int | None:
    """When process pid started, in clock ticks after boot (field 22 of
    /proc/PID/stat, after the command name, which may hold spaces and
    parentheses): with the pid, the process's identity. None: no such process."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def resolve(targets: list, proc: str = "/proc", previous: Resolved | None = None, kube=None,
            log_gone: bool = True) -> Resolved:
    """previous: the targets in force. A pid or cgroup target it held (or
    already had as gone) whose process exited or cgroup was removed is
    reported as gone (logged unless not log_gone, not in the maps), not
    refused: the config may still list it. A new target that does not exist
    is refused. kube: an exporter.capture.kube.Node, which a kubernetes target
    is matched against (the cgroups of the node's pods it names now; none
    without one)."""
    r = Resolved()
    prev = previous or Resolved()
    for i, t in enumerate(targets):
        try:
            if t.kind == "port":
                r.ports.add(t.value)
                key = t.value
            elif t.kind == "pid":
                known = t.value in prev.pids or ("pid", t.value) in prev.gone
                start = start_time(proc, t.value) if tgid(proc, t.value) == t.value else None
                if known and (("pid", t.value) in prev.gone or start != prev.pid_starts.get(t.value, start)):
                    # Exited: a process that has its number now is another one.
                    r.gone.add(("pid", t.value))
                    continue
                if start is None:
                    raise ConfigError(f"pid {t.value}: no such process (a thread id is not a pid)")
                r.pids.add(t.value)
                r.pid_starts[t.value] = start
                key = t.value
            elif t.kind == "cgroup":
                try:
                    cid, lvl = cgroup_id_level(t.value)
                except ConfigError:
                    if t.value in prev.cgroup_paths or ("cgroup", t.value) in prev.gone:
                        r.gone.add(("cgroup", t.value))
                        continue
                    raise
                r.cgroups[cid] = lvl
                r.cgroup_paths[t.value] = cid
                key = cid
            elif t.kind == "netns":
                key = netns_inode(t.value, proc)
                r.netns.add(key)
            elif t.kind == "kubernetes":
                continue                     # matched below, on top of the others (with_kubernetes)
            if t.records:
                r.kinds[t.kind, key] = r.kinds.get((t.kind, key), 0) | kind_bits(t.records)
        except ConfigError as e:
            raise ConfigError(f"captures[{i}].{t.kind}: {e}") from None
    r = with_kubernetes(r, targets, kube)
    for kind, value in sorted(r.gone, key=str) if log_gone else ():
        log.warning("captures: %s %s is gone (%s) and not captured; remove it from the config",
                    kind, value, "the process exited" if kind == "pid" else "the cgroup was removed")
    return r


def with_kubernetes(base: Resolved, targets: list, kube) -> Resolved:
    """base (the other targets, as resolved at the last apply: its .base
    where it has one) plus the cgroups the kubernetes targets of targets
    match now: a pod's change touches only those, never re-resolves a pid,
    cgroup or netns target (one whose path went away would stop it)."""
    base = base.base if base.base is not None else base
    r = Resolved(base.pids, base.cgroups, base.netns, base.ports, base.pid_starts, base.cgroup_paths, base.gone,
                 base.kinds)
    r.base = base
    for t in targets:
        if t.kind != "kubernetes":
            continue
        found = kube.match(t.value) if kube is not None else {}
        r.cgroups.update(found)
        r.matched[str(t.value)] = sorted(found)
        for cid in found if t.records else ():
            r.kinds["cgroup", cid] = r.kinds.get(("cgroup", cid), 0) | kind_bits(t.records)
    levels = sorted(set(r.cgroups.values()))
    if len(levels) > MAX_CGROUP_LEVELS:
        raise ConfigError(f"captures: cgroup targets sit at {len(levels)} different levels {levels}; "
                          f"at most {MAX_CGROUP_LEVELS} are matched in the kernel")
    return r
