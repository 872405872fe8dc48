"""Test oracles: the pure-Python ring walker and JSON-lines writer that nettap's
compiled ones (exporter/capture/_jsonl.c) are checked against, byte for byte.
They are slow and plain on purpose, and ship with the tests, not with nettap
(one implementation per hot path; docs/architecture.md).

The writer is columnar: a batch is turned into Python values column by
column (``tolist()``), then into one JSON line per record with keys in byte
order and the payload in base64, so binary and non-UTF-8 bytes survive.
"""
from __future__ import annotations

import base64
import json
import socket
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from exporter.capture.records import (AF_NAMES, CHUNK, CHUNK_DATA, CHUNK_FLAGS, DIRECTIONS, EOF_, LOG,
                                      LOG_CODES, PROBES, RB_BUSY, RB_DISCARD, RB_HDR, TCP_STATES)

_LEN_MASK = ~(RB_BUSY | RB_DISCARD) & 0xFFFFFFFF


def walk(buf: bytes, record: np.dtype, start: int = 0, end: Optional[int] = None) -> Tuple[np.ndarray, int, int]:
    """Record-by-record walk of ring-format bytes ``buf[start:end]``.

    Returns (records of the expected size, count of bad records, offset
    reached). A record whose length is not the layout's size is counted bad
    and skipped by its own length; a length that runs past ``end`` ends the
    walk (a cut-short record), and so does a BUSY record.
    """
    end = len(buf) if end is None else end
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
            if n == record.itemsize:
                good.append(bytes(buf[pos + RB_HDR:pos + RB_HDR + n]))
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


_KNOWN_FLAGS = sum(bit for bit, _ in CHUNK_FLAGS)


def _flags(v: int) -> str:
    names = [f'"{n}"' for bit, n in CHUNK_FLAGS if v & bit]
    if v & ~_KNOWN_FLAGS:                   # bits this decoder does not know, as a number
        names.append(f'"{v & ~_KNOWN_FLAGS:#x}"')
    return "[" + ",".join(names) + "]"


def _name(names, i: int) -> str:
    """names[i], or the number itself for a value this decoder does not know."""
    return names[i] if 0 <= i < len(names) and names[i] else str(i)


def chunk_lines(recs: np.ndarray) -> Iterator[str]:
    """One JSON line per chunk record (keys in byte order)."""
    cols = {f: recs[f].tolist() for f in CHUNK.names if f != "data"}
    data = recs["data"]
    for i in range(len(recs)):
        n = cols["len"][i]
        fam = cols["family"][i]
        payload = base64.b64encode(data[i].tobytes()[:min(n, CHUNK_DATA)]).decode()
        yield (f'{{"call_len":{cols["call_len"][i]},"call_offset":{cols["call_offset"][i]},'
               f'"comm":{_text(cols["comm"][i])},"conn_id":{cols["conn_id"][i]},'
               f'"daddr":"{_addr(fam, cols["daddr"][i])}","data":"{payload}",'
               f'"direction":"{_name(DIRECTIONS, cols["direction"][i])}","dport":{cols["dport"][i]},'
               f'"family":"{AF_NAMES.get(fam, str(fam))}","flags":{_flags(cols["flags"][i])},'
               f'"len":{n},"offset":{cols["offset"][i]},"pid":{cols["pid"][i]},'
               f'"saddr":"{_addr(fam, cols["saddr"][i])}","sport":{cols["sport"][i]},'
               f'"tid":{cols["tid"][i]},"ts_ns":{cols["ts_ns"][i]},"type":"chunk"}}')


def eof_lines(recs: np.ndarray) -> Iterator[str]:
    cols = {f: recs[f].tolist() for f in EOF_.names}
    for i in range(len(recs)):
        fam = cols["family"][i]
        st = cols["oldstate"][i]
        yield (f'{{"comm":{_text(cols["comm"][i])},"conn_id":{cols["conn_id"][i]},'
               f'"daddr":"{_addr(fam, cols["daddr"][i])}","dport":{cols["dport"][i]},'
               f'"family":"{AF_NAMES.get(fam, str(fam))}",'
               f'"oldstate":"{_name(TCP_STATES, st)}",'
               f'"pid":{cols["pid"][i]},"rx_bytes":{cols["rx_bytes"][i]},"rx_calls":{cols["rx_calls"][i]},'
               f'"saddr":"{_addr(fam, cols["saddr"][i])}","sport":{cols["sport"][i]},'
               f'"start_ns":{cols["start_ns"][i]},"tid":{cols["tid"][i]},"ts_ns":{cols["ts_ns"][i]},'
               f'"tx_bytes":{cols["tx_bytes"][i]},"tx_calls":{cols["tx_calls"][i]},"type":"eof"}}')


def log_lines(recs: np.ndarray) -> Iterator[str]:
    cols = {f: recs[f].tolist() for f in LOG.names}
    for i in range(len(recs)):
        p = cols["probe"][i]
        yield (f'{{"arg0":{cols["arg0"][i]},"arg1":{cols["arg1"][i]},'
               f'"code":"{LOG_CODES.get(cols["code"][i], cols["code"][i])}",'
               f'"comm":{_text(cols["comm"][i])},"pid":{cols["pid"][i]},'
               f'"probe":"{_name(PROBES, p)}",'
               f'"tid":{cols["tid"][i]},"ts_ns":{cols["ts_ns"][i]},"type":"log"}}')


LINES = {"capture_chunks": chunk_lines, "capture_eof": eof_lines, "logs": log_lines}


def lines(ring: str, recs: np.ndarray) -> List[str]:
    """The reference writer: one str per record, without newlines."""
    return list(LINES[ring](recs))


def reference_jsonl(ring: str, recs: np.ndarray) -> bytes:
    """The reference writer's lines as a sink writes them: UTF-8, each ended by a newline."""
    return "".join([line + "\n" for line in LINES[ring](recs)]).encode("utf-8", "surrogateescape")
