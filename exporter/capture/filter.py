"""The kernel's capture filter: resolved targets (exporter/capture/targets.py)
written into the filter maps of a loaded object, and watched.

:class:`TargetMaps` writes a resolved set into the maps, changing only what
differs (and undoing a change that fails half-way), so captures change at
run time without reloading any program. :class:`TargetWatch` notices when a
pid target's process exits (a pidfd polled for exit) or a cgroup target is
removed, drops it from the kernel's maps (a process reusing the pid is not
captured), logs it and counts it (``nettap_targets_gone_total``). A gone
target that the config still lists is reported on each reload, not refused.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import threading

from exporter.capture import sampling
from exporter.capture.targets import TARGET_MAPS, Resolved, kind_bits, start_time
from exporter.config import ConfigError
from exporter.kernel import maps, tcp_h
from exporter.util.wakeup import Wakeup

log = logging.getLogger(__name__)


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
    return {r: ring_bytes[r] // WAKEUP_FRACTION for r in ("capture_chunks", "capture_eof", "obs_events")}


def config_bytes(**fields) -> bytes:
    """struct nettap_capture_config (bpf/tcp.h), every field given by name."""
    size, layout = tcp_h.STRUCTS["nettap_capture_config"]
    if set(fields) != {f[0] for f in layout}:
        raise ValueError(f"capture_config: fields {sorted(fields)}, not {sorted(f[0] for f in layout)}")
    out = bytearray(size)
    for name, off, _ctype, _count, nbytes, *_ in layout:
        out[off:off + nbytes] = fields[name].to_bytes(nbytes, "little")
    return bytes(out)


ALL_KINDS = tuple(tcp_h.NAMES["KIND"].values())


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


def pid_bitmap(pids) -> list:
    """capture_pid_bits' words: bit (tgid & 63) of word ((tgid >> 6) & 1023)
    set for each pid (bpf/maps.bpf.h)."""
    words = [0] * 1024
    for p in pids:
        words[(p >> 6) & 1023] |= 1 << (p & 63)
    return words


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
        self._bitmap = [0] * 1024            # capture_ports: the captured ports
        self._pid_bits = [0] * 1024          # capture_pid_bits: capture_pids' prefilter
        self._config = bytes(tcp_h.STRUCTS["nettap_capture_config"][0])   # as last written (starts zeroed)
        self._settings = None                # (max_payload_bytes, wakeup_bytes, records, sample) of the last apply
        self.gone_total = {"pid": 0, "cgroup": 0}
        self.on_change = None                # called after each apply (TargetWatch's Wakeup.wake)

    def check(self, new: Resolved) -> None:
        """Refuse targets the maps cannot hold (ConfigError), before any write."""
        for attr, name, kind in TARGET_MAPS:
            n, cap = len(getattr(new, attr)), self.capacity.get(name)
            if cap is not None and n > cap:
                raise ConfigError(f"captures: {n} {kind} targets, more than the {cap} the kernel map "
                                  f"{name} holds (its max_entries)")

    def apply(self, new: Resolved, max_payload_bytes: int, wakeup_bytes: dict, records=ALL_KINDS,
              sample: int = 1) -> None:
        """Make new the targets in force, as one transaction: on any failed
        write every write made is undone (the maps hold the old targets
        exactly, current is unchanged) and the error raised. Entries are
        added, then capture_config switched, then stale entries removed, so
        no call is missed while targets change; where a map cannot hold old
        and new at once, the stale entries go first. wakeup_bytes: ring ->
        its wakeup threshold (capture_chunks, capture_eof), as
        :func:`wakeup_thresholds` gives them. records: the record kinds
        published (their names, as the lines' "type"). sample: 1 in sample
        connections kept (capture.sample_connections; sampling.py)."""
        self.check(new)
        old = self.current
        undo: list = []
        fits = all(len(set(getattr(old, a)) | set(getattr(new, a))) <= self.capacity.get(name, 1 << 62)
                   for a, name, _ in TARGET_MAPS)
        bitmap = [0] * 1024
        for p in new.ports:
            bitmap[p >> 6] |= 1 << (p & 63)
        pid_bits = pid_bitmap(new.pids)
        cfg = config_bytes(flags=new.flags, cgroup_levels=new.cgroup_levels, max_payload_bytes=max_payload_bytes,
                           wakeup_bytes=wakeup_bytes["capture_chunks"], eof_wakeup_bytes=wakeup_bytes["capture_eof"],
                           wakeup_check_bytes=wakeup_check_bytes(wakeup_bytes["capture_chunks"]),
                           obs_wakeup_bytes=wakeup_bytes["obs_events"], records=kind_bits(records),
                           sample_threshold=sampling.threshold(sample), sample_connections=sample)
        before, after = self._entries(old), self._entries(new)
        try:
            if not fits:
                self._remove_stale(before, after, undo)
            for name, key in sorted(k for k, v in after.items() if before.get(k) != v):    # new, or asking another
                self._write(name, key, after[name, key], before.get((name, key)), undo)
            self._write_words("capture_ports", bitmap, self._bitmap, undo)
            # the pids' prefilter: new bits before the config, stale ones after (with the entries)
            both = [a | b for a, b in zip(pid_bits, self._pid_bits)]
            self._write_words("capture_pid_bits", both, self._pid_bits, undo)
            self._write("capture_config", _u32(0), cfg, self._config, undo)
            if fits:
                self._remove_stale(before, after, undo)
            self._write_words("capture_pid_bits", pid_bits, both, undo)
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except OSError as e:       # the kernel refused to restore: say so, loudly
                    log.error("captures: rolling back a failed change: %s", e)
            raise
        self._bitmap, self._pid_bits = bitmap, pid_bits
        self._config = cfg
        self._settings = (max_payload_bytes, wakeup_bytes, records, sample)
        self.current = new
        if self.on_change:
            self.on_change()

    def reapply(self, new: Resolved) -> bool:
        """Make new the targets in force with the settings of the last apply
        (kubernetes targets followed between reloads); False before any."""
        if self._settings is None:
            return False
        self.apply(new, *self._settings)
        return True

    # -- the transaction's steps, each recording how to undo itself --
    @staticmethod
    def _entries(r: Resolved) -> dict:
        """(map, key) -> value of the hash maps' entries for r's targets: what
        each asks (bpf/tcp.h NETTAP_MATCH_*: a bit, and its record kinds')."""
        def ask(kind, v):
            return _u32(tcp_h.MATCH_CAPTURE | r.kinds.get((kind, v), 0))
        out = {("capture_pids", _u32(p)): ask("pid", p) for p in r.pids}
        out.update({("capture_cgroups", _u64(c)): ask("cgroup", c) for c in r.cgroups})
        out.update({("capture_netns", _u32(n)): ask("netns", n) for n in r.netns})
        out.update({("capture_port_kinds", _u32(p)): ask("port", p) for p in r.ports})
        return out

    def _remove_stale(self, was: dict, now: dict, undo: list) -> None:
        for name, key in sorted(was.keys() - now.keys()):
            maps.delete(self.fds[name], key)
            undo.append(lambda name=name, key=key: maps.update(self.fds[name], key, was[name, key]))

    def _write_words(self, name: str, now: list, then: list, undo: list) -> None:
        """Write the words of an array of u64 that differ."""
        for word, (bits, was) in enumerate(zip(now, then)):
            if bits != was:
                self._write(name, _u32(word), _u64(bits), _u64(was), undo)

    def _write(self, name: str, key: bytes, value: bytes, was: bytes | None, undo: list) -> None:
        """Write an entry; undone by writing was back, or deleting it where it had none."""
        maps.update(self.fds[name], key, value)
        undo.append(lambda: maps.update(self.fds[name], key, was) if was is not None
                    else maps.delete(self.fds[name], key))

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
        self._wakeup = Wakeup()
        self._pidfds: dict = {}              # pid -> pidfd
        self._unwatched: set = set()          # pids without a pidfd (fd limit): checked each interval
        self._thread = threading.Thread(target=self._run, name="nettap-targets", daemon=True)
        target_maps.on_change = self._wakeup.wake

    def start(self) -> "TargetWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.wake()
        if self._thread.is_alive():
            self._thread.join(5)
        self.tm.on_change = None
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._wakeup.close()

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

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wakeup.fileno(), select.POLLIN)
        while not self._stop.is_set():
            try:
                new = self._sync(poller)
                if new:
                    with self.lock:
                        self.tm.drop_gone(pids=new)
                by_fd = {fd: pid for pid, fd in self._pidfds.items()}
                exited = set()
                for fd, _ in poller.poll(self.interval * 1000):
                    if fd == self._wakeup.fileno():
                        self._wakeup.drain()
                    elif fd in by_fd:
                        exited.add(by_fd[fd])
                if self._stop.is_set():
                    return
                with self.lock:
                    self.tm.drop_gone(pids=exited | self._unwatched, exited=exited)
            except Exception:                # noqa: BLE001 - the watch must outlive one bad round
                log.exception("captures: watching the targets")
                self._stop.wait(self.interval)

