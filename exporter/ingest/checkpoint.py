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

import json
import os
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
    when the file is not one (the caller says so and starts over)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    try:
        doc = json.loads(data)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {VERSION}")
        f = doc["file"]
        fid = None if f is None else FileId(int(f["dev"]), int(f["ino"]), str(f["fp"]))
        offset = int(doc["offset"])
        cuts = tuple(int(c) for c in doc["cuts"])
        if offset < 0 or any(b <= a for a, b in zip((offset,) + cuts, cuts)):
            raise ValueError("offsets not increasing")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a nettap ingest checkpoint: {e}") from None
    return Checkpoint(fid, offset, cuts)


def save(path: str, cp: Checkpoint) -> None:
    """Replace the checkpoint at path (raises OSError)."""
    f = cp.file
    doc = {"version": VERSION, "file": None if f is None else {"dev": f.dev, "ino": f.ino, "fp": f.fp},
           "offset": cp.offset, "cuts": list(cp.cuts)}
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(doc, separators=(",", ":")).encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
