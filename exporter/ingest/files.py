"""The capture's files as ingest sees them: ``path`` (written), then
``path.1`` ... ``path.N`` (older), as exporter.capture.sinks rotates them.

A file is known by its identity, not its name: (st_dev, st_ino) and a
fingerprint of its first line, since a deleted file's inode number comes
back for the next one. Each file is read through a descriptor held from the
moment it is first seen: a rename does not change what a descriptor reads,
so a file keeps its place in the order however often rotation renames it.

Nothing here writes, and nothing blocks on the network: :mod:`forwarder`
decides what is sent.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections import namedtuple
from typing import Dict, List, Optional, Tuple

FP_BYTES = 4096          # a first line is fingerprinted on at most this many bytes
MISSING_SCANS = 3        # scans a file still linked may be missed (a rename between two lstats) before it is gone


class FileId(namedtuple("FileId", "dev ino fp")):
    """A capture file's identity: it names the file in message ids and in
    the checkpoint."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.dev}:{self.ino}:{self.fp}"


class Tracked:
    """A file ingest holds open: where it is in the order (seq: larger is
    newer) and what it is."""

    __slots__ = ("fid", "fd", "seq", "name", "missing")

    def __init__(self, fid: FileId, fd: int, seq: int, name: str) -> None:
        self.fid, self.fd, self.seq, self.name = fid, fd, seq, name
        self.missing = 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def deleted(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0


def fingerprint(fd: int) -> Optional[str]:
    """16 hex digits of the file's first line (up to FP_BYTES), or None
    while that line is not complete."""
    head = os.pread(fd, FP_BYTES, 0)
    end = head.find(b"\n")
    if end < 0 and len(head) < FP_BYTES:
        return None
    return hashlib.blake2b(head if end < 0 else head[:end + 1], digest_size=8).hexdigest()


def count_lines(fd: int, start: int, end: Optional[int] = None) -> int:
    """Lines in [start, end) of a file (a tail without a newline is one)."""
    n, pos, last = 0, start, b"\n"
    while end is None or pos < end:
        piece = os.pread(fd, 1 << 20 if end is None else min(1 << 20, end - pos), pos)
        if not piece:
            break
        n += piece.count(b"\n")
        last = piece[-1:]
        pos += len(piece)
    return n + (last != b"\n")


class Files:
    """The files at ``path`` and its backups, oldest first, each opened once.

    ``scan()`` looks at the names again and returns what went away since:
    files deleted (rotation removed the oldest, or someone else did) or moved
    out of the names; their descriptors are the caller's to read and close
    (:meth:`release`)."""

    def __init__(self, path: str, backups: int) -> None:
        self.path = path
        self.names = [f"{path}.{i}" for i in range(backups, 0, -1)] + [path]
        self.known: Dict[Tuple[int, int], Tracked] = {}
        self._seq = 0
        self.order: List[Tracked] = []           # present at the last scan, oldest first

    def _open(self, name: str, st: os.stat_result) -> Optional[Tracked]:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP):
                return None
            raise
        fst = os.fstat(fd)
        fp = fingerprint(fd) if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino) else None
        if fp is None:                          # renamed under us, or its first line not complete yet
            os.close(fd)
            return None
        self._seq += 1
        return Tracked(FileId(fst.st_dev, fst.st_ino, fp), fd, self._seq, name)

    def scan(self) -> List[Tracked]:
        """Look at the names: returns the files gone since the last scan."""
        seen: List[Tracked] = []
        ids = set()
        for name in self.names:
            try:
                st = os.lstat(name)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = (st.st_dev, st.st_ino)
            if key in ids:                      # a rename between two lstats: seen twice
                continue
            t = self.known.get(key)
            if t is None:                       # new: newer than every file known (the capture creates
                t = self._open(name, st)        # only at path), and the names are walked oldest first
                if t is None:
                    continue
                self.known[key] = t
            t.name, t.missing = name, 0
            ids.add(key)
            seen.append(t)
        gone = []
        for key, t in list(self.known.items()):
            if key in ids:
                continue
            t.missing += 1
            if t.deleted() or t.missing >= MISSING_SCANS:
                gone.append(t)
                del self.known[key]
        self.order = seen
        return gone

    def newest(self) -> Optional[Tracked]:
        return self.order[-1] if self.order else None

    def at_path(self, t: Tracked) -> bool:
        """Is t the file being written (the one at ``path``)?"""
        return bool(self.order) and self.order[-1] is t and t.name == self.path

    def after(self, seq: int) -> Optional[Tracked]:
        """The oldest file newer than the one numbered seq (0: the oldest)."""
        for f in self.order:
            if f.seq > seq:
                return f
        return None

    def find(self, fid: FileId) -> Optional[Tracked]:
        t = self.known.get((fid.dev, fid.ino))
        return t if t is not None and t.fid == fid else None

    def release(self, t: Tracked) -> None:
        self.known.pop((t.fid.dev, t.fid.ino), None)
        try:
            os.close(t.fd)
        except OSError:
            pass

    def close(self) -> None:
        for t in list(self.known.values()):
            self.release(t)
        self.order = []
