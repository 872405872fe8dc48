"""Ring records: the numpy layouts of bpf/tcp.h and their JSON lines.

Each dtype mirrors one C struct of ``bpf/tcp.h`` (tests/unit/test_layout.py
checks names, offsets and sizes against the BTF in ``bpf/tcp.bpf.o``).
:data:`SLOTS` wraps each in the 8-byte ring-buffer record header
(``struct bpf_ringbuf_hdr``: u32 len with the BUSY and DISCARD bits, u32
pg_off) and pads it to its stride, so a run of records in ring memory is one
numpy array.

Decoding is columnar: a batch is turned into Python values column by column
(``tolist()``), then into one JSON line per record with keys in byte order
and the payload in base64, so binary and non-UTF-8 bytes survive. That
pure-Python writer (:func:`lines`) is the reference; :func:`jsonl`, which the
sinks use, hands a whole batch to the compiled writer (``exporter/_jsonl.c``,
built by ``pip install``) when it is built: the same bytes, 20-50x faster, and
without the interpreter lock.
"""
from __future__ import annotations

import base64
import json
import logging
import socket
from typing import Dict, Iterator, List

import numpy as np

from .tcp_h import (CHUNK_DATA, MAX_CGROUP_LEVEL, MAX_PAYLOAD_BYTES, PROBES, RINGS,  # noqa: F401
                    STRIDES, TARGET_CGROUP, TARGET_NETNS, TARGET_PID, TARGET_PORT)

DIRECTIONS = ("egress", "ingress")
CHUNK_FLAGS = ((1, "read_failed"), (2, "no_conn"))
LOG_CODES = {1: "read_user_failed", 2: "conn_table_full", 3: "inflight_full", 4: "iov_truncated",
             5: "payload_unreadable"}
AF_NAMES = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6"}
TCP_STATES = ("", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT",
              "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING", "NEW_SYN_RECV", "BOUND_INACTIVE")

# kernel/bpf/ringbuf.c: BPF_RINGBUF_BUSY_BIT, BPF_RINGBUF_DISCARD_BIT, BPF_RINGBUF_HDR_SZ
RB_BUSY = 1 << 31
RB_DISCARD = 1 << 30
RB_HDR = 8

CAPTURE_CONFIG = np.dtype([("flags", "<u4"), ("cgroup_levels", "<u4"),
                           ("max_payload_bytes", "<u4"), ("wakeup_bytes", "<u4"),
                           ("eof_wakeup_bytes", "<u4"), ("wakeup_check_bytes", "<u4")])
PROBE_COUNTERS = np.dtype([("calls", "<u8"), ("returns", "<u8"), ("bytes", "<u8"), ("chunks", "<u8")])

_CONN = [("family", "<u2"), ("sport", "<u2"), ("dport", "<u2")]

CHUNK = np.dtype([
    ("conn_id", "<u8"), ("ts_ns", "<u8"), ("offset", "<u8"), ("call_offset", "<u8"),
    ("call_len", "<u4"), ("len", "<u4"), ("pid", "<u4"), ("tid", "<u4"),
    *_CONN, ("direction", "u1"), ("flags", "u1"),
    ("saddr", "S16"), ("daddr", "S16"), ("comm", "S16"), ("data", f"V{CHUNK_DATA}"),
])
EOF_ = np.dtype([
    ("conn_id", "<u8"), ("ts_ns", "<u8"), ("start_ns", "<u8"), ("tx_bytes", "<u8"), ("rx_bytes", "<u8"),
    ("pid", "<u4"), ("tid", "<u4"), *_CONN, ("oldstate", "u1"), ("pad0", "u1"),
    ("saddr", "S16"), ("daddr", "S16"), ("comm", "S16"), ("tx_calls", "<u8"), ("rx_calls", "<u8"),
])
LOG = np.dtype([
    ("ts_ns", "<u8"), ("code", "<u4"), ("probe", "<u4"), ("arg0", "<u8"), ("arg1", "<u8"),
    ("pid", "<u4"), ("tid", "<u4"), ("comm", "S16"),
])
RECORDS = {"capture_chunks": CHUNK, "capture_eof": EOF_, "logs": LOG}
C_NAMES = {"capture_chunks": "nettap_chunk", "capture_eof": "nettap_eof", "logs": "nettap_log"}


def stride(record: np.dtype) -> int:
    """Bytes one record takes in ring memory: header + record, 8-aligned."""
    return (RB_HDR + record.itemsize + 7) & ~7


def slot_dtype(record: np.dtype) -> np.dtype:
    """Ring header + record + padding, as laid out in ring memory."""
    return np.dtype({"names": ["rb_len", "rb_pg_off", "rec"],
                     "formats": ["<u4", "<u4", record],
                     "offsets": [0, 4, RB_HDR], "itemsize": stride(record)})


SLOTS = {ring: slot_dtype(rec) for ring, rec in RECORDS.items()}
assert {r: s.itemsize for r, s in SLOTS.items()} == STRIDES, "tcp_h.STRIDES disagrees with the dtypes"


# ---- JSON lines --------------------------------------------------------

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


# ---- the compiled writer (exporter/_jsonl.c) ---------------------------

log = logging.getLogger(__name__)
KINDS = {"capture_chunks": 0, "capture_eof": 1, "logs": 2}     # _jsonl.c: KIND_*
# The longest line one record can give, newline included, whichever writer
# (every field at its widest, every comm byte escaped, a full payload): the
# pipeline bounds its queue by these before formatting. tests/unit/test_jsonl.py
# checks them against the compiled writer's own bounds and extreme records.
LINE_MAX = {"capture_chunks": 1536, "capture_eof": 1024, "logs": 1024}


def _quoted(names) -> list:
    """A name table for _jsonl.init(): item i is value i's name as a quoted
    JSON string, or None where the reference prints the number (_name)."""
    if isinstance(names, dict):
        names = [names.get(i) for i in range(max(names) + 1)]
    return [json.dumps(n).encode() if n else None for n in names]


def _load_compiled():
    """(module, None) when the compiled writer is built and agrees with the
    dtypes and name tables here, else (None, why not)."""
    try:
        from . import _jsonl
    except ImportError as e:
        return None, f"exporter._jsonl is not built ({e})"
    try:
        layout = _jsonl.layout()
        for ring, rec in RECORDS.items():
            want = (rec.itemsize, {f: rec.fields[f][1] for f in rec.names})
            if layout[ring] != want:
                return None, f"exporter._jsonl's {ring} layout {layout[ring]} is not the dtype's {want}"
        _jsonl.init(_quoted(DIRECTIONS), [(bit, json.dumps(n).encode()) for bit, n in CHUNK_FLAGS],
                    _quoted(TCP_STATES), _quoted(LOG_CODES), _quoted(PROBES))
    except Exception as e:                  # a stale or foreign build: the reference still works
        return None, f"exporter._jsonl refused: {e}"
    return _jsonl, None


_compiled, WRITER_PROBLEM = _load_compiled()
WRITER = "compiled" if _compiled is not None else "python"      # which writer jsonl() uses
_announced = False


def compiled():
    """The compiled writer module (exporter/_jsonl.c), or None when it is
    not built or was refused (then the reference writer and numpy do)."""
    return _compiled


def jsonl(ring: str, recs: np.ndarray) -> bytes:
    """Every record's JSON line, each ended by a newline, as UTF-8 bytes (what
    a sink writes): by the compiled writer in one call without the
    interpreter lock when it is built, else by the reference writer. Both
    give the same bytes (tests/unit/test_jsonl.py)."""
    if _compiled is not None and recs.ndim == 1 and recs.dtype == RECORDS[ring]:
        return _compiled.format(KINDS[ring], recs)
    return reference_jsonl(ring, recs)


def announce_writer() -> None:
    """Log, once a process, which JSON-lines writer is in use."""
    global _announced
    if _announced:
        return
    _announced = True
    if _compiled is not None:
        log.info("JSON lines: compiled writer (exporter._jsonl)")
    else:
        log.warning("JSON lines: pure-Python writer (20-50x slower than the compiled one): %s", WRITER_PROBLEM)
