"""Capture targets: from config items to entries of the kernel's filter maps.

:func:`resolve` checks that each target exists and turns it into what the
BPF programs compare against: a tgid, a cgroup v2 id and level, a network
namespace inode, a port bit. :class:`TargetMaps` writes a resolved set into
the maps of a loaded object, changing only what differs, so captures change
at run time without reloading any program.

A pid target is the process that had the pid when the target was first
applied (its start time, /proc/PID/stat field 22), and a cgroup target the
cgroup at its path then. :class:`TargetWatch` notices when such a process
exits (a pidfd polled for exit) or such a cgroup is removed, drops it from
the kernel's maps (a process reusing the pid is not captured), logs it and
counts it (``nettap_targets_gone_total``). A gone target that the config
still lists is reported on each reload, not refused.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import struct
import threading

from exporter.kernel import maps
from exporter.util.mounts import read as read_mountinfo
from exporter.config import ConfigError
from exporter.kernel.tcp_h import (MAX_CGROUP_LEVEL, MAX_CGROUP_LEVELS, TARGET_CGROUP, TARGET_NETNS, TARGET_PID,
                                   TARGET_PORT)

log = logging.getLogger(__name__)

# The hash maps holding each kind of target (bpf/maps.bpf.h), and the kind's name.
TARGET_MAPS = (("pids", "capture_pids", "pid"), ("cgroups", "capture_cgroups", "cgroup"),
               ("netns", "capture_netns", "netns"))


class Resolved:
    """What the programs compare against (a plain class: no dataclasses import
    on the path to attaching the probes)."""

    def __init__(self, pids=None, cgroups=None, netns=None, ports=None, pid_starts=None,
                 cgroup_paths=None, gone=None):
        self.pids = set(pids or ())
        self.cgroups = dict(cgroups or {})          # cgroup id -> level
        self.netns = set(netns or ())
        self.ports = set(ports or ())
        # Identity: pid -> its process's start time (clock ticks after boot),
        # config path -> cgroup id; and the (kind, value) targets the config
        # lists whose process exited or cgroup was removed (not in the maps).
        self.pid_starts = dict(pid_starts or {})
        self.cgroup_paths = dict(cgroup_paths or {})
        self.gone = set(gone or ())

    def without(self, gone) -> "Resolved":
        """A copy with the gone (kind, value) targets taken out of the maps' sets."""
        pids = {v for k, v in gone if k == "pid"}
        paths = {v for k, v in gone if k == "cgroup"}
        ids = {self.cgroup_paths[p] for p in paths if p in self.cgroup_paths}
        keep_paths = {p: c for p, c in self.cgroup_paths.items() if p not in paths}
        ids -= set(keep_paths.values())          # another listed path names the same cgroup
        return Resolved(self.pids - pids, {c: l for c, l in self.cgroups.items() if c not in ids},
                        self.netns, self.ports, {p: t for p, t in self.pid_starts.items() if p not in pids},
                        keep_paths, self.gone | set(gone))

    def __eq__(self, other) -> bool:
        return isinstance(other, Resolved) and (self.pids, self.cgroups, self.netns, self.ports) == \
            (other.pids, other.cgroups, other.netns, other.ports)

    def __repr__(self) -> str:
        return (f"Resolved(pids={self.pids}, cgroups={self.cgroups}, netns={self.netns}, ports={self.ports}"
                + (f", gone={self.gone}" if self.gone else "") + ")")

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


def resolve(targets: list, proc: str = "/proc", previous: Resolved | None = None) -> Resolved:
    """previous: the targets in force. A pid or cgroup target it held (or
    already had as gone) whose process exited or cgroup was removed is
    reported as gone (logged, not in the maps), not refused: the config may
    still list it. A new target that does not exist is refused."""
    r = Resolved()
    prev = previous or Resolved()
    for i, t in enumerate(targets):
        try:
            if t.kind == "port":
                r.ports.add(t.value)
            elif t.kind == "pid":
                known = t.value in prev.pids or ("pid", t.value) in prev.gone
                start = start_time(proc, t.value) if _tgid(proc, t.value) == t.value else None
                if known and (("pid", t.value) in prev.gone or start != prev.pid_starts.get(t.value, start)):
                    # Exited: a process that has its number now is another one.
                    r.gone.add(("pid", t.value))
                    continue
                if start is None:
                    raise ConfigError(f"pid {t.value}: no such process (a thread id is not a pid)")
                r.pids.add(t.value)
                r.pid_starts[t.value] = start
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
            elif t.kind == "netns":
                r.netns.add(netns_inode(t.value, proc))
        except ConfigError as e:
            raise ConfigError(f"captures[{i}].{t.kind}: {e}") from None
    levels = sorted(set(r.cgroups.values()))
    if len(levels) > MAX_CGROUP_LEVELS:
        raise ConfigError(f"captures: cgroup targets sit at {len(levels)} different levels {levels}; "
                          f"at most {MAX_CGROUP_LEVELS} are matched in the kernel")
    for kind, value in sorted(r.gone, key=str):
        log.warning("captures: %s %s is gone (%s) and not captured; remove it from the config",
                    kind, value, "the process exited" if kind == "pid" else "the cgroup was removed")
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


def wakeup_check_bytes(threshold: int, cpus: int | None = None) -> int:
    """Ring bytes a CPU publishes on capture_chunks between two looks at the
    ring's fill (each look is a helper call reading two cache lines the
    reader and the other CPUs write: a tenth of a captured call's cost). The
    reader is woken at most this much per CPU later than a look at every call
    would wake it, so together the CPUs overshoot the threshold by at most a
    quarter of it more, out of the three quarters of the ring left above it."""
    cpus = cpus or os.cpu_count() or 1
    # No floor above one byte: a floor would break the bound on a small ring
    # with many CPUs; there the look is made at every call, as without this.
    return max(1, threshold // (4 * cpus))


class TargetMaps:
    """The filter maps of one loaded object. Not thread-safe: one writer
    (the caller holds a lock shared with :class:`TargetWatch`)."""

    def __init__(self, map_fds: dict, map_info: dict | None = None, proc: str = "/proc"):
        """map_info: the loaded maps' (type, key size, value size,
        max_entries) by name, for the capacity of each target map."""
        self.fds = map_fds
        self.proc = proc
        self.capacity = {name: (map_info or {})[name][3] for _, name, _ in TARGET_MAPS
                         if name in (map_info or {})}
        self.current = Resolved()
        self._bitmap = [0] * 1024
        self._config = bytes(24)             # capture_config as last written (an array map starts zeroed)
        self._settings = None                # (max_payload_bytes, wakeup_bytes) of the last apply
        self.gone_total = {"pid": 0, "cgroup": 0}
        self.on_change = None                # called after each apply (TargetWatch.wake)

    def check(self, new: Resolved) -> None:
        """Refuse targets the maps cannot hold (ConfigError), before any write."""
        for attr, name, kind in TARGET_MAPS:
            n, cap = len(getattr(new, attr)), self.capacity.get(name)
            if cap is not None and n > cap:
                raise ConfigError(f"captures: {n} {kind} targets, more than the {cap} the kernel map "
                                  f"{name} holds (its max_entries)")

    def apply(self, new: Resolved, max_payload_bytes: int, wakeup_bytes: dict) -> None:
        """Make new the targets in force, as one transaction: on any failed
        write every write made is undone (the maps hold the old targets
        exactly, current is unchanged) and the error raised. Entries are
        added, then capture_config switched, then stale entries removed, so
        no call is missed while targets change; where a map cannot hold old
        and new at once, the stale entries go first. wakeup_bytes: ring ->
        its wakeup threshold (capture_chunks, capture_eof), as
        :func:`wakeup_thresholds` gives them."""
        self.check(new)
        old = self.current
        undo: list = []
        fits = all(len(set(getattr(old, a)) | set(getattr(new, a))) <= self.capacity.get(name, 1 << 62)
                   for a, name, _ in TARGET_MAPS)
        bitmap = [0] * 1024
        for p in new.ports:
            bitmap[p >> 6] |= 1 << (p & 63)
        # struct nettap_capture_config: flags, cgroup_levels, max_payload_bytes,
        # wakeup_bytes (capture_chunks), eof_wakeup_bytes (capture_eof), wakeup_check_bytes
        cfg = struct.pack("<IIIIII", new.flags, new.cgroup_levels, max_payload_bytes,
                          wakeup_bytes["capture_chunks"], wakeup_bytes["capture_eof"],
                          wakeup_check_bytes(wakeup_bytes["capture_chunks"]))
        try:
            if not fits:
                self._remove_stale(old, new, undo)
            for key in self._keys(new, old):
                self._add(*key, undo)
            for word, (bits, was) in enumerate(zip(bitmap, self._bitmap)):
                if bits != was:
                    self._write("capture_ports", _u32(word), _u64(bits), _u64(was), undo)
            self._write("capture_config", _u32(0), cfg, self._config, undo)
            if fits:
                self._remove_stale(old, new, undo)
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except OSError as e:       # the kernel refused to restore: say so, loudly
                    log.error("captures: rolling back a failed change: %s", e)
            raise
        self._bitmap = bitmap
        self._config = cfg
        self._settings = (max_payload_bytes, wakeup_bytes)
        self.current = new
        if self.on_change:
            self.on_change()

    # -- the transaction's steps, each recording how to undo itself --
    @staticmethod
    def _keys(a: Resolved, b: Resolved):
        """(map, key) of the entries a has and b has not."""
        yield from (("capture_pids", _u32(p)) for p in sorted(a.pids - b.pids))
        yield from (("capture_cgroups", _u64(c)) for c in sorted(a.cgroups.keys() - b.cgroups.keys()))
        yield from (("capture_netns", _u32(n)) for n in sorted(a.netns - b.netns))

    def _add(self, name: str, key: bytes, undo: list) -> None:
        maps.update(self.fds[name], key, b"\1")
        undo.append(lambda: maps.delete(self.fds[name], key))

    def _remove_stale(self, old: Resolved, new: Resolved, undo: list) -> None:
        for name, key in self._keys(old, new):
            maps.delete(self.fds[name], key)
            undo.append(lambda name=name, key=key: maps.update(self.fds[name], key, b"\1"))

    def _write(self, name: str, key: bytes, value: bytes, was: bytes, undo: list) -> None:
        maps.update(self.fds[name], key, value)
        undo.append(lambda: maps.update(self.fds[name], key, was))

    # -- targets that went away --
    def drop_gone(self, pids=None, exited=()) -> list:
        """Drop from the maps the pid targets among pids (default: all)
        whose process exited (in exited, or another start time now) and
        the cgroup targets whose cgroup was removed; count them. Returns
        their (kind, value), sorted."""
        cur = self.current
        gone = {("pid", p) for p in cur.pids & set(exited)}
        for p in cur.pids if pids is None else cur.pids & set(pids):
            now, then = start_time(self.proc, p), cur.pid_starts.get(p)
            if now is None or (then is not None and now != then):
                gone.add(("pid", p))
        for path, cid in cur.cgroup_paths.items():
            try:
                same = os.stat(path).st_ino == cid
            except OSError:
                same = False
            if not same:
                gone.add(("cgroup", path))
        if not gone or self._settings is None:
            return []
        self.apply(cur.without(gone), *self._settings)
        out = sorted(gone, key=str)
        for kind, value in out:
            self.gone_total[kind] += 1
            log.warning("captures: %s %s is gone (%s): dropped from the kernel's filter%s", kind, value,
                        "the process exited" if kind == "pid" else "the cgroup was removed",
                        "; a process that reuses the pid is not captured" if kind == "pid" else "")
        return out


class TargetWatch:
    """A thread that drops gone targets from a :class:`TargetMaps` (under
    lock, the one its writer holds) as soon as they go: each pid target's
    process through a pidfd, which the kernel makes readable when the
    process exits (before its pid can be reused: that waits for the parent
    to reap it), each cgroup target by a stat of its path every interval s
    (cgroup ids are 64-bit and never reused, so a late look is harmless)."""

    def __init__(self, target_maps: TargetMaps, lock, interval: float = 1.0):
        self.tm, self.lock, self.interval = target_maps, lock, interval
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pidfds: dict = {}              # pid -> pidfd
        self._unwatched: set = set()          # pids without a pidfd (fd limit): checked each interval
        self._thread = threading.Thread(target=self._run, name="nettap-targets", daemon=True)
        target_maps.on_change = self.wake

    def start(self) -> "TargetWatch":
        self._thread.start()
        return self

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join(5)
        self.tm.on_change = None
        for fd in (*self._pidfds.values(), self._wake_r, self._wake_w):
            os.close(fd)
        self._pidfds.clear()

    def _open(self, pid: int) -> int | None:
        """A pidfd for pid, or None: exited already, or no fd left (then
        the pid is checked every interval instead)."""
        try:
            return os.pidfd_open(pid)
        except OSError as e:
            if e.errno != errno.EMFILE:
                return None                   # ESRCH: exited already
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:                       # a pidfd a target: up to the maps' 1,024
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            try:
                return os.pidfd_open(pid)
            except OSError:
                pass
        self._unwatched.add(pid)
        return None

    def _sync(self, poller) -> set:
        """Watch exactly the pids in force; returns the pids new to the
        watch, to check once their pidfd is open (their process may have
        exited, or the pid been reused, since their start time was read)."""
        with self.lock:
            pids = set(self.tm.current.pids)
        for pid in set(self._pidfds) - pids:
            fd = self._pidfds.pop(pid)
            poller.unregister(fd)
            os.close(fd)
        self._unwatched &= pids
        new = pids - set(self._pidfds) - self._unwatched
        for pid in new:
            fd = self._open(pid)
            if fd is not None:
                self._pidfds[pid] = fd
                poller.register(fd, select.POLLIN)
        return new

    def _drain_wake(self) -> None:
        while True:
            try:
                if not os.read(self._wake_r, 4096):
                    return
            except BlockingIOError:
                return

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            try:
                new = self._sync(poller)
                if new:
                    with self.lock:
                        self.tm.drop_gone(pids=new)
                by_fd = {fd: pid for pid, fd in self._pidfds.items()}
                exited = set()
                for fd, _ in poller.poll(self.interval * 1000):
                    if fd == self._wake_r:
                        self._drain_wake()
                    elif fd in by_fd:
                        exited.add(by_fd[fd])
                if self._stop.is_set():
                    return
                with self.lock:
                    self.tm.drop_gone(pids=exited | self._unwatched, exited=exited)
            except Exception:                # noqa: BLE001 - the watch must outlive one bad round
                log.exception("captures: watching the targets")
                self._stop.wait(self.interval)


class TargetsCollector:
    """``nettap_targets_gone_total{kind}``: pid and cgroup targets dropped
    because their process exited or their cgroup was removed."""

    def __init__(self, target_maps: TargetMaps):
        self.tm = target_maps

    def _family(self):
        from prometheus_client.core import CounterMetricFamily
        return CounterMetricFamily("nettap_targets_gone",
                                   "Capture targets dropped from the kernel's filter because their process exited "
                                   "(kind pid) or their cgroup was removed (kind cgroup).", labels=["kind"])

    def describe(self):
        return [self._family()]

    def collect(self):
        fam = self._family()
        for kind, n in sorted(self.tm.gone_total.items()):
            fam.add_metric([kind], n)
        return [fam]
