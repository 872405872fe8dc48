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
        data = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
        try:
            self._write(data)
            self.written += len(lines)
        except (OSError, ValueError) as e:
            self.errors += 1
            self.lost += len(lines)
            now = time.monotonic()
            if now - self._last_log > 10:       # at most one line per 10 s
                self._last_log = now
                log.error("sink %s: write failed, %d records lost so far: %s", self.name, self.lost, e)

    def _write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class StdoutSink(Sink):
    name = "stdout"

    def __init__(self, stream=None) -> None:
        super().__init__()
        self.stream = stream or sys.stdout.buffer

    def _write(self, data: bytes) -> None:
        self.stream.write(data)
        self.stream.flush()


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
        self._f = open(self.path, "ab", buffering=0)
        self._size = self._f.tell()

    def _rotate(self) -> None:
        self._f.close()
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
        view = memoryview(data)
        while view:                      # a short write on a full disk raises on the next try
            n = self._f.write(view)
            self._size += n
            view = view[n:]

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def make(output) -> Optional[Sink]:
    """The sink for a config.Output, or None for type none."""
    if output.type == "jsonl":
        return JsonlFileSink(output.path, output.max_bytes, output.backups)
    if output.type == "stdout":
        return StdoutSink()
    return None
