"""``nettap read FILE...``: nettap's JSON-lines captures read back.

Lists the captured connections, prints one connection's byte streams in
stream order (text or hex) with what was not captured marked, and writes a
pcap of synthesized TCP segments that Wireshark and tshark follow.

The files are read twice, through the descriptors opened at start (a
rotation meanwhile renames files, it does not change what a descriptor
reads): a first pass keeps per connection only offsets and lengths, to list
and filter; a second pass keeps the payload of the connections selected.
Lines that are not records (not JSON, a cut last line, a type or field this
reader does not know) are counted and skipped, reported in one line on
stderr.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import re
import sys
from bisect import bisect_right
from typing import Dict, Iterator, List, Optional, Tuple

from .logsafe import escape
from .outpath import open_regular

DIRECTIONS = ("egress", "ingress")          # records.DIRECTIONS, without importing numpy
_ROTATED = re.compile(r"^(.*)\.(\d+)$")
# Fields a record must have, with their JSON types, for this reader to use it.
_INT, _STR = int, str
_CHUNK = {"conn_id": _INT, "ts_ns": _INT, "offset": _INT, "call_offset": _INT, "call_len": _INT,
          "len": _INT, "pid": _INT, "sport": _INT, "dport": _INT, "family": _STR, "saddr": _STR,
          "daddr": _STR, "comm": _STR, "data": _STR, "direction": _STR, "flags": list}
_EOF = {"conn_id": _INT, "ts_ns": _INT, "start_ns": _INT, "tx_bytes": _INT, "rx_bytes": _INT,
        "pid": _INT, "sport": _INT, "dport": _INT, "family": _STR, "saddr": _STR, "daddr": _STR,
        "comm": _STR, "oldstate": _STR}
_LOG = {"code": _STR}
_MARK = {"ts_ns": _INT, "time": _STR, "pid": _INT}     # a run's start and stop (sinks.mark_line)
SCHEMAS = {"chunk": _CHUNK, "eof": _EOF, "log": _LOG, "start": _MARK, "stop": _MARK}
# The largest value each integer field can hold in the kernel's record
# (bpf/tcp.h); a larger one is not nettap's and would break the pcap.
_U16, _U32, _U64 = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
_MAX = {"sport": _U16, "dport": _U16, "pid": _U32, "len": _U32, "call_len": _U64}
# A line longer than this is no record (a chunk's is ~1 KiB): skipped, and
# never read into memory whole.
MAX_LINE = 1 << 20


def ordered(paths: List[str]) -> List[str]:
    """Oldest first: each rotated set (``x.3``, ``x.2``, ``x.1``, ``x``, in
    any order on the command line) by descending suffix, the sets in the
    order their first file was named."""
    first: Dict[str, int] = {}
    keyed = []
    for p in dict.fromkeys(paths):
        m = _ROTATED.match(p)
        base, n = (m.group(1), int(m.group(2))) if m else (p, 0)
        first.setdefault(base, len(first))
        keyed.append((first[base], -n, p))
    return [p for *_, p in sorted(keyed)]


class Problems:
    """Lines skipped, counted by reason, with the first place each was met."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        self.first: Dict[str, str] = {}

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, where)

    def line(self) -> Optional[str]:
        if not self.counts:
            return None
        parts = [f"{n} {r} (first: {self.first[r]})" for r, n in self.counts.items()]
        return f"nettap read: skipped {sum(self.counts.values())} line(s): " + "; ".join(parts)


def _check(rec, where: str, problems: Problems) -> Optional[dict]:
    """rec if it is a record this reader can use, else None (counted)."""
    if not isinstance(rec, dict):
        problems.add("not a JSON object", where)
        return None
    kind = rec.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        problems.add(f"of unknown type {json.dumps(kind)}", where)
        return None
    for f, t in schema.items():
        v = rec.get(f)
        if not isinstance(v, t) or isinstance(v, bool) or (t is int and not 0 <= v <= _MAX.get(f, _U64)):
            problems.add(f"{kind} record(s) with a missing or bad {f}", where)
            return None
    if kind == "chunk":
        if rec["direction"] not in DIRECTIONS:
            problems.add("chunk record(s) with a bad direction", where)
            return None
        try:
            rec["data"] = base64.b64decode(rec["data"], validate=True)
        except (binascii.Error, ValueError):
            problems.add("chunk record(s) whose data is not base64", where)
            return None
        if len(rec["data"]) != rec["len"]:
            problems.add("chunk record(s) whose data is not len bytes", where)
            return None
    return rec


def records(files, problems: Optional[Problems], want=None) -> Iterator[dict]:
    """The usable records of files [(name, binary file, bytes to read)], in
    order; problems counts the others (None: a second pass, already counted).
    want(rec) -> bool, asked before the payload is decoded, drops the rest."""
    for name, f, size in files:
        f.seek(0)
        left = size
        for lineno, raw in enumerate(_lines(f), 1):
            if left <= 0:
                break
            left -= len(raw) if raw is not None else 0
            if raw is None:                     # over MAX_LINE: skipped unread
                if problems is not None:
                    problems.add(f"longer than {MAX_LINE} bytes", f"{name}:{lineno}")
                left = size - f.tell()
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):  # UnicodeDecodeError included; nesting past the stack
                if problems is not None:
                    cut = not raw.endswith(b"\n") and left <= 0
                    problems.add("cut last line" if cut else "not JSON", f"{name}:{lineno}")
                continue
            if want is not None and isinstance(rec, dict) and not want(rec):
                continue
            rec = _check(rec, f"{name}:{lineno}", problems if problems is not None else Problems())
            if rec is not None:
                yield rec


def _lines(f) -> Iterator[Optional[bytes]]:
    """f's lines, each read whole only up to MAX_LINE bytes: a longer one is
    None, its rest read past in pieces (bounded memory for any file)."""
    while True:
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(MAX_LINE)
        yield None


# ---- connections ---------------------------------------------------------

class Stream:
    """One direction of a connection: which bytes were captured, the calls
    they came from, and (second pass) the bytes."""

    def __init__(self, keep: bool) -> None:
        self.spans: List[List[int]] = []      # captured and readable [start, end)
        self.unreadable: List[List[int]] = []
        self.calls: Dict[int, List[int]] = {}  # call_offset -> [call_len, bytes captured]
        self.pieces: Optional[list] = [] if keep else None   # (offset, data, call_offset, ts_ns)

    def add(self, rec: dict) -> None:
        off, n, co = rec["offset"], rec["len"], rec["call_offset"]
        call = self.calls.setdefault(co, [rec["call_len"], 0])
        call[1] += n
        spans = self.unreadable if "read_failed" in rec["flags"] else self.spans
        if n:
            if spans and spans[-1][1] == off:  # chunks come in stream order: stays one span
                spans[-1][1] += n
            else:
                spans.append([off, off + n])
        if self.pieces is not None and n and spans is self.spans:
            self.pieces.append((off, rec["data"], co, rec["ts_ns"]))

    def end(self, total: int = 0) -> int:
        """Bytes this direction moved: to the end of its last call, or the eof total."""
        return max([total] + [co + c[0] for co, c in self.calls.items()])

    def holes(self, total: int = 0) -> List[Tuple[int, int, str]]:
        """What was not captured, as (offset, bytes, why): ``truncated`` (the
        tail of a call past max_payload_bytes), ``unreadable`` (the kernel
        could not read the payload), ``lost`` (records lost on the way)."""
        have = _merged(self.spans + self.unreadable)
        bad = _merged(self.unreadable)
        starts = sorted(self.calls)
        out, pos = [], 0
        for s, e in have + [(self.end(total), self.end(total))]:
            if s > pos:
                out += self._why(pos, s, starts)
            pos = max(pos, e)
        out += [(s, e - s, "unreadable") for s, e in bad]
        return sorted(out)

    def _why(self, a: int, b: int, starts: List[int]) -> List[Tuple[int, int, str]]:
        """[a, b) split into the truncated tails of calls and what was lost
        (a loop: thousands of truncated calls in a row recursed past the stack)."""
        out = []
        while a < b:
            i = bisect_right(starts, a) - 1
            if i < 0:
                break
            co = starts[i]
            call_len, got = self.calls[co]
            if not (got < call_len and a < co + call_len):
                break
            cut = min(b, co + call_len)
            out.append((a, cut - a, "truncated"))
            a = cut
        if a < b:
            out.append((a, b - a, "lost"))
        return out

    def runs(self) -> List[Tuple[int, bytes]]:
        """The captured bytes as (offset, bytes) runs in stream order,
        overlaps (a record written twice) kept once."""
        out: List[Tuple[int, bytearray]] = []
        pos = 0
        for off, data, *_ in sorted(self.pieces, key=lambda p: p[0]):
            if off + len(data) <= pos:
                continue
            if off < pos:
                data, off = data[pos - off:], pos
            if out and off == pos:
                out[-1][1].extend(data)
            else:
                out.append((off, bytearray(data)))
            pos = off + len(data)
        return [(o, bytes(d)) for o, d in out]


def _merged(spans) -> List[Tuple[int, int]]:
    out: List[List[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class Conn:
    """A connection as the records name it: nettap's conn_id and its
    addresses (a conn_id alone is not unique across nettap restarts)."""

    def __init__(self, key: tuple, rec: dict, keep: bool) -> None:
        self.key = key
        self.conn_id, self.family, self.saddr, self.sport, self.daddr, self.dport = key
        self.pid, self.comm = rec["pid"], rec["comm"]
        self.pids = {rec["pid"]}
        self.first_ts = rec["ts_ns"]
        self.streams = {d: Stream(keep) for d in DIRECTIONS}
        self.eof: Optional[dict] = None

    def add(self, rec: dict) -> None:
        self.pids.add(rec["pid"])
        self.first_ts = min(self.first_ts, rec["ts_ns"])
        if rec["type"] == "chunk":
            self.streams[rec["direction"]].add(rec)
        else:
            self.eof = rec

    def total(self, direction: str) -> int:
        return self.eof[("tx_bytes", "rx_bytes")[DIRECTIONS.index(direction)]] if self.eof else 0

    def ends(self, direction: str) -> Tuple[str, str]:
        """(from, to) of the direction's bytes."""
        loc, rem = _endpoint(self.family, self.saddr, self.sport), _endpoint(self.family, self.daddr, self.dport)
        return (loc, rem) if direction == "egress" else (rem, loc)


def _endpoint(family: str, addr: str, port: int) -> str:
    addr = escape(addr)                         # any string a file holds: shown, never obeyed
    return f"[{addr}]:{port}" if family == "ipv6" else f"{addr}:{port}"


def _key(rec: dict) -> tuple:
    return (rec["conn_id"], rec["family"], rec["saddr"], rec["sport"], rec["daddr"], rec["dport"])


class Capture:
    """Connections and record counts of a set of capture files."""

    def __init__(self) -> None:
        self.conns: Dict[tuple, Conn] = {}
        self.counts = {"chunk": 0, "eof": 0, "log": 0, "start": 0, "stop": 0}
        self.logs: Dict[str, int] = {}
        self.marks: List[Tuple[str, str, int]] = []   # (start or stop, time, pid) in file order
        self.no_conn = 0                        # chunks of connections nettap had no room for
        self._portless: Dict[tuple, tuple] = {}  # key without the local port -> key

    def add(self, rec: dict, keep: bool = False) -> None:
        kind = rec["type"]
        self.counts[kind] += 1
        if kind == "log":
            self.logs[rec["code"]] = self.logs.get(rec["code"], 0) + 1
            return
        if kind in ("start", "stop"):
            self.marks.append((kind, rec["time"], rec["pid"]))
            return
        if rec["conn_id"] == 0:                 # no connection state: offsets unknown
            self.no_conn += kind == "chunk"
            return
        key = _key(rec)
        if kind == "eof" and key not in self.conns and rec["sport"] == 0:
            # At TCP_CLOSE the kernel has released the local port already
            # (tcp_set_state: inet_put_port() before the state store): the
            # eof record's sport may be 0. Its chunks had it.
            key = self._portless.get(key[:3] + key[4:], key)
        c = self.conns.get(key)
        if c is None:
            c = self.conns[key] = Conn(key, rec, keep)
            self._portless[key[:3] + key[4:]] = key
        c.add(rec)


def capture_gaps(marks: List[Tuple[str, str, int]]) -> List[str]:
    """What no nettap captured, from the runs' start and stop lines in file
    order: a stop, or a run that ended without one (killed, crashed, out of
    memory), up to the next start."""
    out, running, last = [], None, None        # running: the start of the run in progress
    for kind, when, pid in marks:
        if kind == "start":
            if running is not None:
                out.append(f"the run started {running[0]} (pid {running[1]}) has no stop line: it ended "
                           f"uncleanly; nothing was captured from its last record until {when}")
            elif last is not None:
                out.append(f"nothing was captured from the stop at {last} until the start at {when}")
            running, last = (when, pid), None
        else:
            running, last = None, when
    if running is not None and sum(kind == "start" for kind, _, _ in marks) > 1:
        out.append(f"the run started {running[0]} (pid {running[1]}) has no stop line yet (still running, "
                   "or it ended uncleanly)")
    return out


def select(conns, ports=(), pids=(), ids=()) -> List[Conn]:
    return [c for c in conns
            if (not ports or c.sport in ports or c.dport in ports)
            and (not pids or c.pids & set(pids))
            and (not ids or c.conn_id in ids)]


# ---- text output ---------------------------------------------------------

def listing(cap: Capture, conns: List[Conn], out) -> None:
    rows = [("CONN", "LOCAL", "REMOTE", "PID", "COMM", "TX", "RX", "TRUNCATED", "GAPS", "CLOSED")]
    for c in conns:
        trunc_calls = trunc_bytes = gaps = gap_bytes = 0
        for d, s in c.streams.items():
            trunc_calls += sum(got < n for n, got in s.calls.values())
            for _, n, why in s.holes(c.total(d)):
                if why == "truncated":
                    trunc_bytes += n
                else:
                    gaps, gap_bytes = gaps + 1, gap_bytes + n
        pid = str(c.pid) + (f"+{len(c.pids) - 1}" if len(c.pids) > 1 else "")
        rows.append((str(c.conn_id), _endpoint(c.family, c.saddr, c.sport), _endpoint(c.family, c.daddr, c.dport),
                     pid, escape(c.comm), str(c.streams["egress"].end(c.total("egress"))),
                     str(c.streams["ingress"].end(c.total("ingress"))),
                     f"{trunc_calls} call{'s' * (trunc_calls > 1)}, {trunc_bytes} B" if trunc_calls else "-",
                     f"{gaps}, {gap_bytes} B" if gaps else "-", "yes" if c.eof else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    n = cap.counts
    out.write(f"{len(conns)} connection(s) of {len(cap.conns)}; records: {n['chunk']} chunk, "
              f"{n['eof']} eof, {n['log']} log\n")
    if cap.no_conn:
        out.write(f"{cap.no_conn} chunk(s) without a connection (conn_id 0: nettap's connection table "
                  f"was full): in no stream\n")
    if cap.logs:
        out.write("log records: " + ", ".join(f"{escape(k)} {v}" for k, v in sorted(cap.logs.items())) + "\n")
    for gap in capture_gaps(cap.marks):
        out.write(f"capture gap: {escape(gap)}\n")


def _hole_text(off: int, n: int, why: str, s: Stream) -> str:
    if why == "truncated":
        co = max(o for o in s.calls if o <= off)
        return (f"[nettap: {n} bytes not captured at offset {off}: the call of {s.calls[co][0]} bytes "
                f"at offset {co} was truncated (capture.max_payload_bytes)]")
    if why == "unreadable":
        return f"[nettap: {n} bytes at offset {off} unreadable (the kernel could not read the payload)]"
    return f"[nettap: {n} bytes missing at offset {off} (records lost)]"


_CONTROL = {b: "." for b in range(128) if not 32 <= b < 127 and b not in b"\n\t\r"}
_LONE_CR = re.compile(r"\r(?!\n)")


def _text(data: bytes) -> str:
    """Bytes as text: UTF-8 (U+FFFD where it is not), control characters but
    newline, tab and CR LF as '.', as Wireshark's ASCII view shows them."""
    return _LONE_CR.sub(".", data.decode("utf-8", "replace").translate(_CONTROL))


def _hexdump(off: int, data: bytes) -> Iterator[str]:
    for i in range(0, len(data), 16):
        row = data[i:i + 16]
        h = " ".join(f"{b:02x}" for b in row[:8]) + "  " + " ".join(f"{b:02x}" for b in row[8:])
        a = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        yield f"{off + i:08x}  {h:<48}  |{a}|\n"


def streams(c: Conn, out, hexdump: bool) -> None:
    pids = ", ".join(map(str, sorted(c.pids)))
    out.write(f"conn {c.conn_id}: {escape(c.family)} {_endpoint(c.family, c.saddr, c.sport)} -> "
              f"{_endpoint(c.family, c.daddr, c.dport)}, pid {pids} ({escape(c.comm)})"
              f"{', closed' if c.eof else ''}\n")
    for d, s in c.streams.items():
        end = s.end(c.total(d))
        frm, to = c.ends(d)
        runs = s.runs()
        holes = s.holes(c.total(d))
        out.write(f"==> {d} {frm} -> {to}: {end} bytes in {len(s.calls)} call(s), "
                  f"{sum(len(b) for _, b in runs)} captured\n")
        at_line_start = True
        for off, item in sorted([(o, b) for o, b in runs] + [(o, h) for o, *h in holes],
                                key=lambda x: x[0]):
            if isinstance(item, bytes):
                if hexdump:
                    out.writelines(_hexdump(off, item))
                else:
                    t = _text(item)
                    out.write(t)
                    at_line_start = t.endswith("\n")
            else:
                out.write(("" if at_line_start else "\n") + _hole_text(off, *item, s) + "\n")
                at_line_start = True
        if not at_line_start:
            out.write("\n")


# ---- the command ---------------------------------------------------------

def _args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="nettap read",
        description="Read nettap's JSON-lines capture files (rotated ones included, taken oldest first: "
                    "capture.jsonl.3 ... capture.jsonl.1, capture.jsonl). Without --conn or --pcap: "
                    "list the connections.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--conn", type=int, action="append", default=[], metavar="ID",
                   help="print this connection's byte streams, each direction in stream order, "
                        "with what was not captured marked (repeatable; with --pcap: only filters)")
    p.add_argument("--hex", action="store_true", help="with --conn: a hex dump instead of text")
    p.add_argument("--port", type=int, action="append", default=[], help="only connections with this local or remote port")
    p.add_argument("--pid", type=int, action="append", default=[], help="only connections a call of this process moved")
    p.add_argument("--pcap", metavar="OUT",
                   help="write the connections as synthesized TCP segments to the pcap file OUT "
                        "(Wireshark, tshark; times are CLOCK_MONOTONIC)")
    return p.parse_args(argv)


def main(argv: List[str]) -> int:
    args = _args(argv)
    try:
        return _run(args)
    except BrokenPipeError:                     # the reader went away (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace) -> int:
    files, rc = [], 0
    for name in ordered(args.files):
        try:
            f = os.fdopen(open_regular(name), "rb")      # a FIFO is refused, never waited on
            files.append((name, f, os.fstat(f.fileno()).st_size))
        except OSError as e:
            print(f"nettap read: cannot read {escape(name)}: {e.strerror}", file=sys.stderr)
            rc = 1
    problems = Problems()
    cap = Capture()
    for rec in records(files, problems):
        cap.add(rec)
    line = problems.line()
    if line:
        print(escape(line), file=sys.stderr)
    conns = select(cap.conns.values(), args.port, args.pid, args.conn)
    out = sys.stdout
    if hasattr(out, "reconfigure"):             # payload and task names are UTF-8, whatever the locale
        out.reconfigure(encoding="utf-8", errors="replace")
    if not args.conn and not args.pcap:
        listing(cap, conns, out)
        return rc
    if not conns:
        print("nettap read: no connection matches", file=sys.stderr)
        return 1
    keys = {c.key for c in conns}
    ids = {c.conn_id for c in conns}
    full = Capture()
    for rec in records(files, None, lambda r: r.get("conn_id") in ids):
        full.add(rec, keep=True)
    conns = [full.conns[k] for k in cap.conns if k in keys and k in full.conns]
    if args.pcap:
        from .pcap import write_pcap
        try:
            n, notes = write_pcap(conns, args.pcap)
        except OSError as e:
            print(f"nettap read: cannot write {escape(args.pcap)}: {e.strerror}", file=sys.stderr)
            return 1
        for note in notes:
            print(f"nettap read: {escape(note)}", file=sys.stderr)
        print(f"nettap read: wrote {n} packets of {len(conns) - len(notes)} connection(s) to {args.pcap}",
              file=sys.stderr)
        return rc
    for c in conns:
        streams(c, out, args.hex)
    return rc
