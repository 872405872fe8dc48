"""The files the TLS uprobes are on: libssl files (tls.py) and Go executables (gotls.py), opened
(libfiles.py), attached and released by a thread of their own, within bounds no user's processes push.

A uprobe traps in every process that maps its file, so only the files the
targets' processes map or run are attached (every process's with
capture.tls_attach: node, or while a port target, which names no process
before its socket exists, is in force): looked for at start, at each target
change, when a target maps libssl or runs a program (the dlopen ring) and
every tls.SWEEP_INTERVAL; detached when none of them uses it any more.

Every file is opened, parsed and attached by nettap-tls, never by the drain thread or a reload: a
file that does not answer (a FUSE server that never replies, a process whose maps stay locked) costs
that thread, abandoned after tls.DEADLINE (its imports made before: goelf.warm), and nothing else.
Bounds: tls.MAX_FILES attached at once, tls.MAX_USER_FILES of them brought by one user other than
root, tls.FD_RESERVE fds left free. Each refusal is counted by reason
(nettap_tls_files_refused_total) and logged once a minute.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from exporter.kernel import gotls, libbpf, libfiles, tls
from exporter.kernel import programs as table
from exporter.kernel.objects import destroy_links
from exporter.kernel.tls import (DEADLINE, FAILED_KEPT, FD_RESERVE, FDS_PER_FILE, LIMIT_WHY, MAX_ABANDONED,
                                 MAX_FILES, MAX_USER_FILES, MMAP, PROBES, REASONS, SWEEP_INTERVAL,
                                 free_fds, is_libssl, report, system_files)

log = logging.getLogger(__name__)
ALL_PROBES = PROBES + gotls.PROBES
# why a probe is on no file, when no file was refused either
IDLE = {**dict.fromkeys(PROBES, "no libssl.so file is used by the targets' processes"),
        **dict.fromkeys(gotls.PROBES, "no Go program with crypto/tls runs among the targets' processes")}
TRACEPOINTS = (MMAP, gotls.EXEC)      # the dlopen ring's programs: a libssl mapped, a program run
GONE_RETRIES = 4        # a mapped range not found: its maps read again after 10, 20, 40, 80 ms


class _File:
    """An attached file: its links, the uprobes per probe, whose process
    brought it (uid; None: the linker's directories), and the (device,
    inode) map lines name it by."""

    def __init__(self, path: str, links: list, counts: dict, uid, aliases=()):
        self.path, self.links, self.counts, self.uid = path, links, counts, uid
        self.aliases = set(aliases)


class TlsProbes:
    """The TLS uprobes of one loaded object: which files carry them, and
    their links (close() hands them back to destroy), attached by nettap-tls."""

    def __init__(self, obj: int, variant: str, states: dict | None = None, refused: dict | None = None,
                 proc: str = "/proc", mech: str = "uprobe", map_fds: dict | None = None, processes=None):
        """states: the TLS probes' ProbeStates, kept told; refused: reason ->
        count, counted on (the caller's, so counts outlive this object);
        mech: "uprobe_multi" where obj was loaded for it (tls.prepare);
        map_fds: the object's maps (Go's go_tls_layout, go_conn_types);
        processes: () -> the pids of the targets' processes, or None: every
        process of the node (and the linker's libssl files) is looked at."""
        self.obj, self.variant, self.states, self.proc = obj, variant, states, proc
        self.mech, self.map_fds, self.processes = mech, dict(map_fds or {}), processes
        if "go_tls_layout" in self.map_fds:
            from exporter.kernel import goelf      # (with TLS on only: nettap's start does not pay it)
            gotls.configure(self.map_fds, goelf.BPF_OFFSETS)
        # libssl files mapped and programs run from now on are told on the dlopen ring
        self.links: list = []
        try:
            for name in TRACEPOINTS:
                for cat, tp in table.attach(name):
                    self.links.append(libbpf.call_ptr("bpf_program__attach_tracepoint", self._prog(name),
                                                      cat.encode(), tp.encode()))
        except OSError:
            destroy_links(self.links)
            raise
        self.files: dict = {}       # (dev, ino) -> path attached
        self._held: dict = {}       # (dev, ino) -> _File
        self._seen: dict = {}       # a map line's (dev, ino) -> the file's key, or None: refused for good
        self.failed: dict = {}      # path -> why not (the last FAILED_KEPT)
        self.refused = refused if refused is not None else dict.fromkeys(REASONS, 0)
        self.symbols: dict = {p: 0 for p in ALL_PROBES}   # probe -> uprobes attached, all files
        self._cv = threading.Condition()
        self._obj_lock = threading.Lock()   # held while a worker uses obj (close() then waits)
        self.obj_in_use = False             # close() found a worker stuck in it: obj must stay
        self._pids: set = set()
        self._asked = self._done = 0        # scans asked for and done
        self._closed = False
        self._gen = 0                       # the worker in charge; an abandoned one's work is undone
        self._busy = None                   # (what it waits on, since) of the worker in charge
        self._stuck: set = set()            # pids and files a worker was abandoned on
        self._last_sweep = 0.0
        self._log_at: dict = {}
        self._worker()

    def _prog(self, name: str) -> int:
        return libbpf.call_ptr("bpf_object__find_program_by_name", self.obj, name.encode())

    # -- asked by others (never waiting on a file) --
    def scan(self, wait: float = 0.0, ask: bool = True) -> bool:
        """Attach to every libssl file not yet attached, the system's and the
        running processes', and release those no process maps any more;
        wait up to `wait` s for it (not ask: for those asked so far); True: done."""
        with self._cv:
            if ask:
                self._asked += 1
                self._cv.notify_all()
            want, end = self._asked, time.monotonic() + wait
            while self._done < want and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
                self._check_stuck()
            return True

    def attach_mapped(self, pids) -> None:
        """These processes mapped a libssl file (dlopen records): attach to
        it if it is new. A process gone already (a short command) is not
        found: its file, if new, waits for the next process that maps it,
        or the next scan."""
        with self._cv:
            self._pids.update(pids)
            self._cv.notify_all()
            self._check_stuck()

    def counts(self) -> dict:
        """For the metrics: files attached, the limit, refusals by reason."""
        with self._cv:
            self._check_stuck()
            return {"files": len(self._held), "refused": dict(self.refused)}

    def files_of(self, probe: str) -> list:
        """The paths of the files attached that carry probe's uprobes."""
        with self._cv:
            return [f.path for f in self._held.values() if f.counts.get(probe)]

    def close(self) -> list:
        """Stop; every link (the caller destroys them). Waits up to DEADLINE
        for a worker attaching (obj_in_use if it is still there)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            links = self.links + [ln for f in self._held.values() for ln in f.links]
            self.links, self._held, self.files = [], {}, {}
        # a worker takes the lock, then looks at _closed: none uses obj after this
        self.obj_in_use = not self._obj_lock.acquire(timeout=DEADLINE)
        if not self.obj_in_use:
            self._obj_lock.release()
        return links

    # -- the worker --
    def _worker(self) -> None:
        threading.Thread(target=self._run, args=(self._gen,), name="nettap-tls", daemon=True).start()

    def _check_stuck(self) -> None:
        """(Under the lock.) A worker waiting on one pid's maps or one file
        past DEADLINE is abandoned: the pid or file is skipped from now on,
        counted (timeout) and logged, and a new worker takes over, up to
        MAX_ABANDONED of them; the abandoned one undoes whatever it made."""
        if self._busy is None or self._closed or time.monotonic() - self._busy[1] < DEADLINE:
            return
        what, _since, label = self._busy
        self._stuck.add(what)
        self._busy = None
        self._gen += 1
        self._refuse("timeout", label, f"no answer within {DEADLINE:g} s; skipped from now on")
        if len(self._stuck) <= MAX_ABANDONED:
            self._worker()
        else:
            log.error("TLS: %d files or processes never answered; no more libssl files are attached", MAX_ABANDONED)

    def _run(self, gen: int) -> None:
        if "go_tls_layout" in self.map_fds:     # before any file's DEADLINE: seconds in an emulated guest
            from exporter.kernel import goelf
            goelf.warm()
        while True:
            with self._cv:
                while (gen == self._gen and not self._closed and not self._pids and self._asked == self._done
                       and time.monotonic() - self._last_sweep < SWEEP_INTERVAL):
                    self._cv.wait(SWEEP_INTERVAL)
                if gen != self._gen or self._closed:
                    return
                pids, self._pids, want = self._pids, set(), self._asked
            try:
                if want != self._done:
                    self._scan_all(gen)
                elif pids:
                    allowed = self._targets()
                    if allowed is not None:     # a netns target's: the ring tells every process
                        pids &= allowed
                    self._take([ln for pid in sorted(pids) for ln in self._lines(pid, gen)], gen)
                else:
                    self._sweep(gen)
            except Exception:                   # a bug: said, and the next request tries again
                log.exception("TLS: looking for libssl files failed")
            with self._cv:
                if gen == self._gen and want != self._done:
                    self._done = want
                    self._cv.notify_all()

    def _wait_on(self, what, gen: int, label: str = "") -> bool:
        """Say what this worker now waits on (label: its name for a log);
        False if the worker was abandoned, or what was skipped for good."""
        with self._cv:
            if gen != self._gen or self._closed:
                return False
            self._busy = (what, time.monotonic(), label) if what else None
            return what not in self._stuck

    def _lines(self, pid, gen: int) -> list:
        """The files of pid the probes may go on: the libssl files it maps,
        and its executable (Go's crypto/tls is linked into it)."""
        pid = int(pid)
        if not self._wait_on(("pid", pid), gen, f"/proc/{pid}/maps"):
            return []
        data = libfiles.read_maps(self.proc, pid)
        self._wait_on(None, gen)
        return libfiles.map_lines(data, pid, self._wanted(pid))

    def _wanted(self, pid: int):
        """path -> whether it is a file of pid's the probes may go on."""
        try:
            exe = os.readlink(os.path.join(self.proc, str(pid), "exe")).removesuffix(" (deleted)")
        except OSError:                 # gone, or a kernel thread
            exe = None
        return lambda path: path == exe or is_libssl(path)

    def _targets(self) -> set | None:
        """The targets' processes' pids; None: any process's files (capture.tls_attach:
        node, or a port target, which names no process before its socket exists)."""
        return None if self.processes is None else self.processes()

    def _all_lines(self, gen: int, pids=None) -> list:
        pids = sorted(pids) if pids is not None else [int(p) for p in os.listdir(self.proc) if p.isdigit()]
        return [ln for pid in pids for ln in self._lines(pid, gen)]

    def _scan_all(self, gen: int) -> None:
        pids = self._targets()
        if pids is None:
            for path in system_files():
                self._take_system(path, gen)
        lines = self._all_lines(gen, pids)
        self._take(lines, gen)
        self._release({ln.key for ln in lines}, gen, system=pids is not None)

    def _sweep(self, gen: int) -> None:
        """Attach to the files of the targets' processes no record told
        (moved into a target cgroup, a dlopen record dropped), and release
        the files none of them uses any more."""
        self._last_sweep = time.monotonic()
        pids = self._targets()
        if pids is not None:
            lines = self._all_lines(gen, pids)
            self._take(lines, gen)
            self._release({ln.key for ln in lines}, gen, system=True)
        elif any(f.uid is not None for f in list(self._held.values())):
            self._release({ln.key for ln in self._all_lines(gen)}, gen)

    # -- one file --
    def _take_system(self, path: str, gen: int) -> None:
        if not self._wait_on(("file", path), gen, path):
            return
        try:
            fd, st = libfiles.open_system(os.path.dirname(path), os.path.basename(path))
        except (OSError, libfiles.Refused):     # a symlink, gone: its file is found where it is
            self._wait_on(None, gen)
            return
        try:
            if (st.st_dev, st.st_ino) not in self._held:
                self._attach(fd, (st.st_dev, st.st_ino), path, None, (), gen)
        finally:
            os.close(fd)
            self._wait_on(None, gen)

    def _take(self, lines: list, gen: int) -> None:
        for ln in lines:
            for attempt in range(GONE_RETRIES + 1):
                with self._cv:
                    if ln.key in self._seen:
                        break
                if not self._wait_on(("file", ln.key), gen, f"{ln.path} (pid {ln.pid})"):
                    break
                try:
                    self._take_line(ln, gen)
                    break
                except libfiles.Refused as e:
                    if e.reason == "gone":
                        ln = self._again(ln, attempt)
                        if ln is None:
                            break
                        continue
                    with self._cv:
                        self._seen[ln.key] = None       # refused for good, until no process maps it
                        self._refuse(e.reason, ln.path, str(e))
                    break
                finally:
                    self._wait_on(None, gen)

    def _again(self, ln, attempt: int):
        """ln's file, read again from its process's maps after its range was
        not found: None if the process no longer maps it. A dlopen record is
        told at mmap(2)'s entry, while ld.so's first mapping of the whole
        file still stands; the mmap it tells then splits that range, so a
        range read in between is gone by the time it is opened."""
        if attempt == GONE_RETRIES:
            return None
        time.sleep(0.01 * 2 ** attempt)
        data = libfiles.read_maps(self.proc, ln.pid)
        return next((m for m in libfiles.map_lines(data, ln.pid, self._wanted(ln.pid)) if m.key == ln.key), None)

    def _take_line(self, ln, gen: int) -> None:
        try:
            uid = os.stat(os.path.join(self.proc, str(ln.pid))).st_uid
        except OSError:
            return
        program = not is_libssl(ln.path)     # an executable: a Go program's, or nothing to attach
        if not program and not self._has_room(uid, ln, gen):
            return
        if libfiles.fs_type(self.proc, ln.pid, ln.dev).split(".")[0] in ("fuse", "fuseblk"):
            raise libfiles.Refused("fuse", f"{ln.path} (pid {ln.pid}): on a FUSE file system (its server "
                                   "could stall every uprobe attach of the node)")
        fd, st = libfiles.open_mapped(ln, self.proc)
        try:
            key = (st.st_dev, st.st_ino)
            with self._cv:
                if key in self._held:
                    self._held[key].aliases.add(ln.key)
                    self._seen[ln.key] = key
                    return
            go = self._inspect(fd, ln.path, (ln.key,)) if program else None
            if program and (go is None or not self._has_room(uid, ln, gen)):
                return
            self._attach(fd, key, ln.path, uid, (ln.key,), gen, go)
        finally:
            os.close(fd)

    def _has_room(self, uid: int, ln, gen: int) -> bool:    # (a sweep in _room waited on other things)
        return self._room(uid, ln.path, gen) and self._wait_on(("file", ln.key), gen, ln.path)

    def _inspect(self, fd: int, path: str, aliases):
        """goelf's reading of the program open at fd (O_PATH), or None: not
        a Go program with crypto/tls (passed over while mapped), or refused
        (counted by goelf's reason)."""
        from exporter.kernel import goelf       # (with TLS on only: nettap's start does not pay it)
        at = f"/proc/self/fd/{fd}"
        try:
            go = goelf.inspect(at)
        except goelf.Refused as e:
            with self._cv:
                self._seen.update(dict.fromkeys(aliases))
                self._refuse(e.reason, path, str(e).replace(at, path))
            return None
        if go is None:
            with self._cv:
                self._seen.update(dict.fromkeys(aliases))
        return go

    def _room(self, uid: int, path: str, gen: int) -> bool:
        """Whether one more file may be attached: MAX_FILES in all,
        MAX_USER_FILES brought by one user other than root, and FD_RESERVE
        fds left after it (reloads, scrapes, the sink). Refused and counted
        if not (after releasing what no process maps, at most once a second)."""
        for attempt in (0, 1):
            with self._cv:
                mine = sum(1 for f in self._held.values() if f.uid == uid)
                if len(self._held) >= MAX_FILES:
                    reason = "limit"
                elif uid != 0 and mine >= MAX_USER_FILES:
                    reason = "user_limit"
                elif free_fds() < FD_RESERVE + max(FDS_PER_FILE[self.mech], gotls.FDS_PER_FILE[self.mech]):
                    reason = "fds"
                else:
                    return True
                if attempt or time.monotonic() - self._last_sweep < 1:
                    self._refuse(reason, path, f"not attached: {LIMIT_WHY[reason]}")
                    return False
            self._sweep(gen)
        return False

    def _attach(self, fd: int, key: tuple, path: str, uid, aliases, gen: int, go=None) -> None:
        """Attach every TLS symbol of the file open at fd (O_PATH), libssl's,
        or Go's crypto/tls where go (goelf.GoTls) read it as a Go program:
        libbpf and the kernel are given /proc/self/fd/N, the very file checked."""
        at = f"/proc/self/fd/{fd}"
        with self._obj_lock:
            if self._closed or gen != self._gen:      # (an abandoned worker back at last)
                return
            if go is None:
                made, counts, error = tls.attach_symbols(self._prog, self.variant, at, self.mech)
            else:
                made, counts, error = gotls.attach_binary(self._prog, self.variant, at, go, self.mech, self.map_fds)
        counts = {**dict.fromkeys(ALL_PROBES, 0), **counts}
        error = error.replace(at, path)
        with self._cv:
            if not error and any(counts.values()) and gen == self._gen and not self._closed:
                self._held[key] = _File(path, made, counts, uid, aliases)
                self.files[key] = path
                self._seen.update(dict.fromkeys(aliases, key))
                for p in ALL_PROBES:
                    self.symbols[p] += counts[p]
                self._report()
                log.info("TLS probes attached to %s", path)
                return
            if gen == self._gen and not self._closed:
                self._seen.update(dict.fromkeys(aliases))
                self._refuse("no_symbols" if not error else "error", path,
                             error or "no SSL_read/SSL_write symbol")
        destroy_links(made)

    def _release(self, live: set, gen: int, system: bool = False) -> None:
        """Detach the files whose every map line is gone (the linker's too
        if system: no longer attached whoever maps them); forget refusals of
        files no process maps (tried again if mapped again)."""
        with self._cv:
            if gen != self._gen or self._closed:
                return
            gone = [k for k, f in self._held.items() if (system or f.uid is not None) and not f.aliases & live]
            files = [self._held.pop(k) for k in gone]
            for k in gone:
                del self.files[k]
            self._seen = {m: k for m, k in self._seen.items() if m in live or k in self._held}
            for f in files:
                for p in ALL_PROBES:
                    self.symbols[p] -= f.counts[p]
            if files:
                self._report()
        for f in files:
            log.info("TLS probes detached from %s: no captured process uses it any more", f.path)
        destroy_links([ln for f in files for ln in f.links])

    def _refuse(self, reason: str, path: str, why: str) -> None:
        """(Under the lock.) Count a refusal; keep why for the probes' state;
        log it, once a minute per reason."""
        self.refused[reason] += 1
        self.failed.pop(path, None)
        self.failed[path] = why
        while len(self.failed) > FAILED_KEPT:
            del self.failed[next(iter(self.failed))]
        now = time.monotonic()
        if now - self._log_at.get(reason, -60.0) >= 60:
            self._log_at[reason] = now
            log.warning("TLS probes not attached to %s: %s (nettap_tls_files_refused_total{reason=\"%s\"})",
                        path, why, reason)
        self._report()

    def _report(self) -> None:
        if self.states is not None:
            report(self.states, self.symbols, self.failed, self.mech, IDLE)
