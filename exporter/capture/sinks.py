"""Where captured records go: JSON lines to a size-rotated file or to
stdout, or nowhere. A sink never raises from a write: a failed write (disk
full, closed pipe, a path refused) is counted in ``errors`` and ``lost`` and
logged, and the next batch is tried again.

The counters live in a :class:`Totals` that successive sinks share (a config
reload replaces the sink): they grow for the process's life, so Prometheus
never sees them reset.

The file sink opens its files through :mod:`exporter.util.outpath` (no link
followed, ownership and mode checked); rotation renames and creates through
the same checked directory fd.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from exporter.util.outpath import OutputRefused, open_dir, open_file, set_mode

log = logging.getLogger(__name__)

DEFAULT_MODE = 0o600


class Totals:
    """Sink counters for the process's life, shared by every sink it makes."""

    def __init__(self) -> None:
        self.written: Dict[str, int] = {}   # sink name -> records written
        self.bytes: Dict[str, int] = {}     # sink name -> bytes written
        self.errors: Dict[str, int] = {}    # sink name -> failed writes
        self.lost = 0                       # records lost at the sink stage, any sink


class Sink:
    name = "none"

    def __init__(self, totals: Optional[Totals] = None) -> None:
        self.totals = totals if totals is not None else Totals()
        # Accounting is shared with abandon(), called by the stopping thread
        # while the sink thread may still be inside a write.
        self._acct = threading.Lock()
        self._batch: Optional[List[int]] = None     # records, records done, bytes done
        self._abandoned = False
        self._last_log = 0.0

    @property
    def written(self) -> int:
        return self.totals.written.get(self.name, 0)

    @property
    def bytes_written(self) -> int:
        return self.totals.bytes.get(self.name, 0)

    @property
    def errors(self) -> int:
        return self.totals.errors.get(self.name, 0)

    @property
    def lost(self) -> int:
        return self.totals.lost

    def open(self) -> None:
        """Make sure the sink can write (raises OSError naming what is wrong)."""

    def write(self, lines: List[str]) -> None:
        if not lines:
            return
        self.write_data(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"), len(lines))

    def write_data(self, data: bytes, count: int) -> None:
        """Write ``count`` records' lines, already formatted: UTF-8, each
        ended by a newline (records.jsonl)."""
        if not count:
            return
        with self._acct:
            if self._abandoned:                 # stop gave up on this sink
                self.totals.lost += count
                return
            self._batch = [count, 0, 0]
        try:
            self._write(data)
        except (OSError, ValueError) as e:
            self._failed(e)
        else:
            self._wrote(count - self._batch[1], len(data) - self._batch[2])
        finally:
            with self._acct:
                self._batch = None

    def _wrote(self, records: int, nbytes: int) -> None:
        """Count whole lines as written (a _write may call it for each piece)."""
        with self._acct:
            if self._abandoned:
                return
            t = self.totals
            t.written[self.name] = t.written.get(self.name, 0) + records
            t.bytes[self.name] = t.bytes.get(self.name, 0) + nbytes
            self._batch[1] += records
            self._batch[2] += nbytes

    def _failed(self, e: Exception) -> None:
        with self._acct:
            if self._abandoned:
                return
            t = self.totals
            t.errors[self.name] = t.errors.get(self.name, 0) + 1
            t.lost += self._batch[0] - self._batch[1]
        now = time.monotonic()
        if not getattr(e, "logged", False) and now - self._last_log > 10:    # at most one line per 10 s
            self._last_log = now
            log.error("sink %s: write failed, %d records lost so far: %s", self.name, self.totals.lost, e)

    def _count_lost(self, n: int) -> None:
        with self._acct:
            self.totals.lost += n

    def abandon(self, queued: int) -> int:
        """The stopping thread gives up on a sink whose thread is still stuck
        in a write (a reader that stopped reading, a hung mount): the batch
        being written and the ``queued`` records behind it are counted lost
        now, and whatever the stuck write does later counts nothing (the
        process is ending). The fd stays open: the stuck thread still uses
        it. Returns the records counted lost."""
        with self._acct:
            self._abandoned = True
            n = queued + (self._batch[0] - self._batch[1] if self._batch else 0)
            self.totals.lost += n
        return n

    def write_mark(self, data: bytes) -> None:
        """Write a start or stop line (:func:`mark_line`): not a captured
        record, so counted in no metric; a failure is logged, not counted."""
        try:
            self._write(data)
        except (OSError, ValueError) as e:
            log.warning("sink %s: a start or stop line was not written: %s", self.name, e)

    def _write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def mark_line(kind: str) -> bytes:
    """The ``start`` or ``stop`` line of this process's run: when (UTC, and
    CLOCK_MONOTONIC ns as the records' ts_ns), pid and version. `nettap
    read` reports the gap between a stop, or a file that ends without one,
    and the next start: what no nettap captured."""
    import json
    from datetime import datetime, timezone
    from exporter import __version__
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return (json.dumps({"pid": os.getpid(), "time": now, "ts_ns": time.monotonic_ns(), "type": kind,
                        "version": __version__}, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class StdoutSink(Sink):
    """Writes to the stdout fd directly, unbuffered: a failed write leaves
    nothing behind to come out later. Writes block while the reader does not
    read (back pressure: the pipeline's queue absorbs it, then counts what
    it drops); stop does not wait for such a reader (Pipeline.stop)."""

    name = "stdout"

    def __init__(self, fd: Optional[int] = None, totals: Optional[Totals] = None) -> None:
        super().__init__(totals)
        self.fd = sys.stdout.fileno() if fd is None else fd

    def _write(self, data: bytes) -> None:
        _write_all(self.fd, data)


class JsonlFileSink(Sink):
    """Appends to ``path``; a file never grows past ``max_bytes``: the line
    that would pass it starts a new file, and the full one becomes
    ``path.1`` (older ones shift to ``.2`` ... ``.backups``, the oldest is
    removed). A deleted or moved file is noticed at the next batch and
    created again; a deleted directory is not (it is the admin's): records
    are counted lost until it exists again."""

    name = "jsonl"
    # (st_dev, st_ino) -> sinks of this process holding that file open: a
    # second sink on the same file (a reload) must not take the first one's
    # line being written for a cut line.
    _held: Dict[Tuple[int, int], int] = {}
    _held_lock = threading.Lock()

    def __init__(self, path: str, max_bytes: int, backups: int, mode: int = DEFAULT_MODE,
                 totals: Optional[Totals] = None, root: Optional[str] = None) -> None:
        super().__init__(totals)
        self.path = path
        self.root = root                     # output.root: the directory must resolve inside it
        self.max_bytes = max_bytes
        self.backups = backups
        self.mode = mode
        self._dirpath, self._name = os.path.split(os.path.abspath(path))
        self._dir: Optional[int] = None      # O_PATH fd of the checked directory
        self._f: Optional[int] = None
        self._id: Optional[Tuple[int, int]] = None
        self._size = 0
        self._ever_opened = False
        self._dir_gone = False
        self.uid = os.geteuid()              # nettap's user: owns the files it writes

    def open(self) -> None:
        """Open the file (at start and reload, so that a path nettap cannot
        use refuses the config; later again after a rotation or a loss).
        Raises OSError saying which file and why."""
        if self._f is not None:
            return
        if self._dir is None:
            self._dir = open_dir(self._dirpath, not self._ever_opened, self.uid, self.root)
        f, st = open_file(self._dir, self._name, self.path, self.mode, self.uid)
        try:
            set_mode(f, st, self.mode)      # only now: a refused file is left as it was
        except OSError as e:
            os.close(f)
            raise OutputRefused(f"cannot set the mode of {self.path}: {e.strerror}", e.errno) from None
        self._f = f
        self._id = (st.st_dev, st.st_ino)
        self._size = st.st_size
        self._ever_opened = True
        with self._held_lock:
            held = self._held.get(self._id, 0)
            self._held[self._id] = held + 1
        if self._size and not held:
            self._end_cut_line()

    def _end_cut_line(self) -> None:
        """A nettap killed mid-write (kill -9, OOM kill, power loss) leaves
        a cut last line. End it with a newline rather than cut it off: the
        file stays append-only (a shipper tailing it has read those bytes
        already and would take a shrinking file for a new one), and the next
        record starts on its own line. A reader sees one line that is not
        JSON; it is counted lost here, as its writer could not count it."""
        if os.pread(self._f, 1, self._size - 1) == b"\n":
            return
        _write_all(self._f, b"\n")
        self._size += 1
        self._count_lost(1)
        log.warning("sink jsonl: %s ended with a cut line (a previous nettap stopped mid-write); ended it "
                    "with a newline, 1 record counted lost", self.path)

    def _close_file(self) -> None:
        if self._f is None:
            return
        os.close(self._f)
        self._f = None
        with self._held_lock:
            n = self._held.pop(self._id, 1) - 1
            if n:
                self._held[self._id] = n

    def _still_there(self) -> bool:
        """Is the open file still the one at the path? One stat a batch."""
        try:
            st = os.stat(self._name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._id

    def _lost_file(self) -> None:
        """The file was deleted or moved away (or its directory deleted):
        writing on would count records as written into a file nobody can
        reach. Close it; open() makes a new one."""
        self._close_file()
        if os.fstat(self._dir).st_nlink == 0:       # the directory itself was removed
            os.close(self._dir)
            self._dir = None
            self._dir_gone = True
            log.error("sink jsonl: directory %s was deleted: records are counted lost "
                      "(nettap_records_lost_total{stage=\"sink\"}) until it exists again", self._dirpath)
        else:
            log.warning("sink jsonl: %s was deleted or moved away; writing to a new one", self.path)

    def _reopen(self) -> None:
        try:
            self.open()
        except OSError as e:
            if self._dir_gone:                      # logged once, when it went
                e.logged = True
            raise
        if self._dir_gone:
            self._dir_gone = False
            log.warning("sink jsonl: directory %s is back; writing to %s again", self._dirpath, self.path)

    def _rotate(self) -> None:
        self._close_file()
        d, n = self._dir, self._name
        try:
            if self.backups == 0:
                os.unlink(n, dir_fd=d)
                return
            for i in range(self.backups - 1, 0, -1):
                try:
                    os.rename(f"{n}.{i}", f"{n}.{i + 1}", src_dir_fd=d, dst_dir_fd=d)
                except FileNotFoundError:
                    pass
            os.rename(n, f"{n}.1", src_dir_fd=d, dst_dir_fd=d)
        except FileNotFoundError:                   # someone removed it first
            pass

    def _append(self, piece) -> None:
        try:
            _write_all(self._f, piece)
        except OSError:
            # A full disk may take part of the piece: cut it off again, so
            # the next batch does not continue half a line.
            try:
                os.ftruncate(self._f, self._size)
            except OSError:
                pass
            raise
        self._size += len(piece)

    def _write(self, data: bytes) -> None:
        if self._f is not None and not self._still_there():
            self._lost_file()
        if self._f is None:
            self._reopen()
        view = memoryview(data)
        pos, end_all = 0, len(data)
        while pos < end_all:
            room = self.max_bytes - self._size
            if end_all - pos <= room:
                end = end_all
            else:
                end = data.rfind(b"\n", pos, pos + max(room, 0)) + 1
            if end <= pos:                          # not one more whole line fits
                if self._size:
                    self._rotate()
                    self.open()
                    continue
                # A single line longer than max_bytes: alone in a file of its
                # own, the only way to keep it whole; the next line rotates it.
                end = data.find(b"\n", pos) + 1 or end_all
            self._append(view[pos:end])
            if end < end_all:
                # A piece before a rotation: its lines count as written now,
                # so a failure later in the batch loses only the rest. The
                # last piece (usually the whole batch) is counted by
                # write_data: bytes.count is a byte-at-a-time loop, and
                # counting every batch's lines cost as much as formatting them.
                self._wrote(data.count(b"\n", pos, end), end - pos)
            pos = end

    def close(self) -> None:
        if self._abandoned:
            return                                  # a stuck write still uses the fds
        self._close_file()
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None


def make(output, totals: Optional[Totals] = None) -> Optional[Sink]:
    """The sink for a config.Output, or None for type none. Nothing is
    opened yet: call open() to find out whether the path can be used."""
    if output.type == "jsonl":
        return JsonlFileSink(output.path, output.max_bytes, output.backups, output.mode, totals, output.root)
    if output.type == "stdout":
        return StdoutSink(totals=totals)
    return None


__all__ = ["Sink", "StdoutSink", "JsonlFileSink", "Totals", "OutputRefused", "make"]
