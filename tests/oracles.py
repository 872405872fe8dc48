"""Test oracles: the pure-Python ring walker and JSON-lines writer that nettap's
compiled ones (exporter/capture/scan.c, writer.c) are checked against, byte for byte.
They are slow and plain on purpose, and ship with the tests, not with nettap
(one implementation per hot path; docs/architecture.md).

The writer walks each kind's field table (exporter/kernel/tcp_h.py, generated
from the object's BTF), as the compiled one does: a batch is turned into
Python values column by column (``tolist()``), then into one JSON line per
record, keys in byte order, each value in its field's JSON form
(docs/records.md), the payload in base64 so binary and non-UTF-8 bytes
survive.
"""
from __future__ import annotations

import base64
import json
import socket
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from exporter.capture import records as R
from exporter.capture.records import AF_NAMES, RB_BUSY, RB_DISCARD, RB_HDR
from exporter.kernel import tcp_h

_LEN_MASK = ~(RB_BUSY | RB_DISCARD) & 0xFFFFFFFF


def walk(buf: bytes, record: np.dtype, start: int = 0, end: Optional[int] = None) -> Tuple[np.ndarray, int, int]:
    """Record-by-record walk of ring-format bytes ``buf[start:end]``.

    Returns (records of the expected kind, count of bad records, offset
    reached). A record whose header's kind is not the layout's, or whose
    length is not its size, is counted bad and skipped by its own length; a
    length that runs past ``end`` ends the walk (a cut-short record), and so
    does a BUSY record.
    """
    end = len(buf) if end is None else end
    number = next(R.NUMBERS[k] for k, d in R.DTYPES.items() if d == record)
    koff, kbytes = R.KIND_FIELD
    good: List[bytes] = []
    bad = 0
    pos = start
    while pos + RB_HDR <= end:
        hdr = int.from_bytes(buf[pos:pos + 4], "little")
        if hdr & RB_BUSY:
            break
        n = hdr & _LEN_MASK
        nxt = pos + ((RB_HDR + n + 7) & ~7)
        if nxt > end or n == 0:
            if n == 0:
                bad += 1
                pos = nxt
                continue
            bad += 1            # cut short
            pos = end
            break
        if not hdr & RB_DISCARD:
            body = bytes(buf[pos + RB_HDR:pos + RB_HDR + n])
            if n == record.itemsize and int.from_bytes(body[koff:koff + kbytes], "little") == number:
                good.append(body)
            else:
                bad += 1
        pos = nxt
    recs = np.frombuffer(b"".join(good), dtype=record) if good else np.empty(0, dtype=record)
    return recs, bad, pos


_addr_cache: Dict[bytes, str] = {}


def _addr(family: int, raw: bytes) -> str:
    # numpy's S16 strips trailing NULs: pad back before formatting.
    key = family.to_bytes(2, "little") + raw
    s = _addr_cache.get(key)
    if s is None:
        raw = raw.ljust(16, b"\0")
        if family == socket.AF_INET6:
            s = socket.inet_ntop(socket.AF_INET6, raw)
        elif family == socket.AF_INET:
            s = socket.inet_ntop(socket.AF_INET, raw[:4])
        else:                               # not an address family nettap records: raw hex
            s = raw.hex()
        if len(_addr_cache) > 65536:
            _addr_cache.clear()
        _addr_cache[key] = s
    return s


def _text(raw: bytes) -> str:
    """A task name: bytes to the first NUL, invalid UTF-8 replaced by U+FFFD
    (as Rust's String::from_utf8_lossy does), JSON-escaped."""
    return json.dumps(raw.split(b"\0", 1)[0].decode("utf-8", "replace"), ensure_ascii=False)


def _flags(v: int, names: dict) -> str:
    known = sum(names)
    out = [f'"{n}"' for bit, n in names.items() if v & bit]
    if v & ~known:                          # bits this decoder does not know, as a number
        out.append(f'"{v & ~known:#x}"')
    return "[" + ",".join(out) + "]"


def _render(form: str, v, rec: dict, nbytes: int) -> str:
    """One value in its JSON form (docs/records.md, "JSON forms")."""
    if not form:
        return str(v)
    if form == "family":
        return f'"{AF_NAMES.get(v, str(v))}"'
    if form == "addr":
        return f'"{_addr(rec["family"], v)}"'
    if form == "text":
        return _text(v)
    if form.startswith("enum:"):
        return f'"{R.names_of(form).get(v, str(v))}"'
    if form.startswith("flags:"):
        return _flags(v, R.names_of(form))
    if form.startswith("base64:"):
        n = rec[form.split(":", 1)[1]]
        return '"' + base64.b64encode(v.tobytes()[:min(n, nbytes)]).decode() + '"'
    raise ValueError(f"unknown JSON form {form!r}")


def _lines(name: str, recs: np.ndarray) -> Iterator[str]:
    """One JSON line per record (name: their kind, or a ring of one kind),
    walking the struct's field table (exporter/kernel/tcp_h.py): keys in byte
    order, "type" the kind."""
    kind = R.kind_of(name)
    fields = tcp_h.STRUCTS[tcp_h.RECORDS[kind][1]][1]
    keyed = sorted([f for f in fields if f[5] not in ("-", "kind")] + [("type",)], key=lambda f: f[0].encode())
    cols = {f[0]: (recs[f[0]] if f[5].startswith("base64:") else recs[f[0]].tolist()) for f in fields}
    for i in range(len(recs)):
        rec = {name: col[i] for name, col in cols.items()}
        yield "{" + ",".join(f'"type":"{kind}"' if len(f) == 1 else f'"{f[0]}":{_render(f[5], rec[f[0]], rec, f[4])}'
                             for f in keyed) + "}"


def lines(ring: str, recs: np.ndarray) -> List[str]:
    """The reference writer: one str per record, without newlines."""
    return list(_lines(ring, recs))


def reference_jsonl(ring: str, recs: np.ndarray) -> bytes:
    """The reference writer's lines as a sink writes them: UTF-8, each ended by a newline."""
    return "".join([line + "\n" for line in _lines(ring, recs)]).encode("utf-8", "surrogateescape")
