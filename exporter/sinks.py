"""Where captured records go: JSON lines to a size-rotated file or to
stdout, or nowhere. A sink never raises: a failed write (disk full, closed
pipe) is counted in ``errors`` and ``lost`` and logged, and the next batch
is tried again."""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import List, Optional

log = logging.getLogger(__name__)


class Sink:
    name = "none"

    def __init__(self) -> None:
        self.written = 0      # records written
        self.errors = 0       # failed writes
        self.lost = 0         # records in failed writes
        self._last_log = 0.0

    def write(self, lines: List[str]) -> None:
        if not lines:
            return
        self.write_data(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"), len(lines))

    def write_data(self, data: bytes, count: int) -> None:
        """Write ``count`` records' lines, already formatted: UTF-8, each
        ended by a newline (records.jsonl)."""
        if not count:
            return
        try:
            self._write(data)
            self.written += count
        except (OSError, ValueError) as e:
            self.errors += 1
            self.lost += count
            now = time.monotonic()
            if now - self._last_log > 10:       # at most one line per 10 s
                self._last_log = now
                log.error("sink %s: write failed, %d records lost so far: %s", self.name, self.lost, e)

    def _write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class StdoutSink(Sink):
    """Writes to the stdout fd directly, unbuffered: a failed write leaves
    nothing behind to come out later."""

    name = "stdout"

    def __init__(self, fd: Optional[int] = None) -> None:
        super().__init__()
        self.fd = sys.stdout.fileno() if fd is None else fd

    def _write(self, data: bytes) -> None:
        _write_all(self.fd, data)


class JsonlFileSink(Sink):
    """Appends to ``path``; once it passes ``max_bytes`` it becomes
    ``path.1`` (older ones shift to ``.2`` ... ``.backups``, the oldest is
    removed) and a new file starts."""

    name = "jsonl"

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        super().__init__()
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._f = None
        self._size = 0

    def _open(self) -> None:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._f = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self._size = os.lseek(self._f, 0, os.SEEK_END)

    def _rotate(self) -> None:
        os.close(self._f)
        self._f = None
        if self.backups == 0:
            os.unlink(self.path)
            return
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")

    def _write(self, data: bytes) -> None:
        if self._f is None:
            self._open()
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
            self._open()
        try:
            _write_all(self._f, data)
        except OSError:
            # A full disk may take part of the batch: cut it off again, so
            # the next batch does not continue half a line.
            try:
                os.ftruncate(self._f, self._size)
            except OSError:
                pass
            raise
        self._size += len(data)

    def close(self) -> None:
        if self._f is not None:
            os.close(self._f)
            self._f = None


def make(output) -> Optional[Sink]:
    """The sink for a config.Output, or None for type none."""
    if output.type == "jsonl":
        return JsonlFileSink(output.path, output.max_bytes, output.backups)
    if output.type == "stdout":
        return StdoutSink()
    return None
