"""Where ingest is: the file it forwards, the offset up to which the
engine acknowledged everything, and the regions it cut after that offset
and may have sent (their end offsets, in order).

The regions are written here *before* their messages leave: after a crash
the same regions are sent again, byte for byte under the same message ids,
and the engine drops what it already stored. A region cut differently would
carry other ids and be stored twice; one forgotten would be lost.

Written to a temporary file and renamed over the old one: a kill at any
moment leaves the old checkpoint or the new one, never half of one. It is
not fsynced: after a power loss the regions may be cut again differently,
and what was in flight is stored twice (never lost: every message id names
its region's both ends).
"""
from __future__ import annotations

import errno
import json
import os
import stat
from collections import namedtuple
from typing import Optional

from exporter.ingest.files import FileId

VERSION = 1


class CheckpointError(ValueError):
    pass


class Checkpoint(namedtuple("Checkpoint", "file offset cuts", defaults=(None, 0, ()))):
    """file: FileId or None (nothing forwarded yet); offset: acknowledged
    up to here; cuts: ends of the regions cut after offset."""

    __slots__ = ()


def load(path: str) -> Optional[Checkpoint]:
    """The checkpoint at path; None when there is none; CheckpointError
    when the file is not one (the caller says so and starts over). Only a
    regular file is read: a FIFO is opened without waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        data = os.read(fd, 1 << 20)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {VERSION}")
        f = doc["file"]
        fid = None if f is None else FileId(int(f["dev"]), int(f["ino"]), str(f["fp"]))
        offset = int(doc["offset"])
        cuts = tuple(int(c) for c in doc["cuts"])
        if offset < 0 or any(b <= a for a, b in zip((offset,) + cuts, cuts)):
            raise ValueError("offsets not increasing")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a nettap ingest checkpoint: {e}") from None
    return Checkpoint(fid, offset, cuts)


def save(path: str, cp: Checkpoint) -> None:
    """Replace the checkpoint at path (raises OSError)."""
    f = cp.file
    doc = {"version": VERSION, "file": None if f is None else {"dev": f.dev, "ino": f.ino, "fp": f.fp},
           "offset": cp.offset, "cuts": list(cp.cuts)}
    tmp = f"{path}.tmp"
    data = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    try:
        os.unlink(tmp)                          # a leftover, or anything planted there (a FIFO would block)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:                                    # a full disk: what was written of it goes too
            os.unlink(tmp)
        except OSError:
            pass
        raise
