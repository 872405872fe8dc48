"""Capture files read back: the records of nettap's JSON-lines files, checked,
and the connections and byte streams made of them (for ``nettap read`` and its
pcap writer).

The files are read twice, through the descriptors opened at start (a
rotation meanwhile renames files, it does not change what a descriptor
reads): a first pass keeps per connection only offsets and lengths, to list
and filter; a second pass keeps the payload of the connections selected.
Lines that are not records (not JSON, a cut last line, a type or field this
reader does not know) are counted and skipped, reported in one line on
stderr.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from bisect import bisect_right
from typing import Dict, Iterator, List, Optional, Tuple

from exporter.capture.kubelines import pod_text
from exporter.kernel import tcp_h
from exporter.util.logsafe import escape

DIRECTIONS = ("egress", "ingress")          # records.DIRECTIONS, without importing numpy
_ROTATED = re.compile(r"^(.*)\.(\d+)$")


def _schema(kind: str) -> dict:
    """A record kind's fields as its lines carry them (docs/records.md: the
    table generated from bpf/tcp.h): key -> (JSON type, largest value of a
    number, what its C type holds)."""
    out = {}
    for name, _off, _ctype, count, nbytes, form, _ in tcp_h.STRUCTS[tcp_h.RECORDS[kind][1]][1]:
        if form in ("-", "kind"):               # padding, left out; the kind, the line's "type"
            continue
        if not form and count > 1:
            raise TypeError(f"{kind}.{name}: an array without a JSON form")
        out[name] = (int, (1 << 8 * nbytes) - 1) if not form else (list if form.startswith("flags:") else str, None)
    return {"conn_id": out.pop("conn_id"), **out}     # first: what a line is filed under, said first if bad


# Fields a line must have, with their JSON types, for this reader to use it:
# every field of a record kind, and the lines nettap writes beside them.
_U64 = (1 << 64) - 1
SCHEMAS = {kind: _schema(kind) for kind in tcp_h.RECORDS}
SCHEMAS["clock"] = {"ts_ns": (int, _U64), "real_ns": (int, _U64),          # pipeline.py's clock track
                    "drops": (dict, None), "lost": (dict, None)}
SCHEMAS["start"] = SCHEMAS["stop"] = {"ts_ns": (int, _U64), "time": (str, None),   # a run's start and stop
                                      "pid": (int, _U64)}                          # (sinks.mark_line)
# Fields added to a kind after nettap wrote files without them: read as this value there.
ADDED = {("owner", "sample"): 1, ("eof", "established_us"): 0}
# What a connection's life records say, in a line each (nettap read --conn).
LIFECYCLE = {
    "state": lambda r: f"{r['oldstate']} -> {r['newstate']}",
    "reset": lambda r: f"reset {'sent' if r['direction'] == 'egress' else 'received'} in {r['state']}",
    "owner": lambda r: (f"owner pid {r['pid']} tid {r['tid']} ({r['comm']}), cgroup {r['cgroup_id']}, "
                        f"learnt at its {r['via'].replace('_', ' ')}"
                        + (f", 1 in {r['sample']} connections sampled" if r["sample"] > 1 else "")
                        + (f", {pod_text(r)}" if "pod_uid" in r else "")),
    "error": lambda r: f"error {r['errno_name']} in {r['state']}",
    "destroy": lambda r: (f"destroyed in {r['state']}: {r['bytes_acked']} B acknowledged, "
                          f"{r['bytes_received']} B received, {r['segs_out']} segments out, {r['segs_in']} in, "
                          f"{r['total_retrans']} retransmitted"),
    "tls_handshake": lambda r: (f"TLS handshake {r['outcome'].replace('_', ' ')} after "
                                f"{r['duration_ns'] / 1e6:.3f} ms, pid {r['pid']}"),
    "retransmit": lambda r: (f"sent again ({r['cause']}) in {r['state']}: RTO {r['rto_jiffies']} jiffies, "
                             f"srtt {r['srtt_us']} us, {r['retransmits']} timer retransmission(s) in a row"),
    "timer": lambda r: (f"{r['timer']} timer fired" + (f" for {r['event'].replace('_', ' ')}" if r['event'] != 'none'
                                                       else "") +
                        f" in {r['state']}: {r['behind_jiffies']} jiffies behind its slot, "
                        f"{r['late_jiffies']} after its expiry" + (", its owner holding the socket" if r['owned']
                                                                   else "")),
    "probe": lambda r: (f"{'zero-window' if r['probe'] == 'window' else r['probe']} probe sent in {r['state']}: "
                        f"{r['probes_out']} unanswered, the peer's window {r['snd_wnd']} B, "
                        f"RTO {r['rto_jiffies']} jiffies"),
    "segment": lambda r: (("segment" if r.get("segs", 1) < 2 else f"{r['segs']} segments, joined,") +
                          f" in: seq {r['seq']}, {r['length']} B; cwnd {r['snd_cwnd']}, "
                          f"ssthresh {r['ssthresh']}, srtt {r['srtt_us']} us, the peer's window {r['snd_wnd']} B, "
                          f"ours {r['rcv_wnd']} B"),
    "timewait": lambda r: (f"TIME_WAIT socket ({r['substate']}) made, {r['timeout_jiffies']} jiffies to its timeout"
                           if r["event"] == "made" else
                           f"TIME_WAIT socket ({r['substate']}) ended: {r['event']} after {r['age_ms']} ms, "
                           f"{r['timeout_jiffies']} jiffies left"),
    # a request, no connection yet (conn_id 0): counted, listed under no connection
    "request": lambda r: (f"request from {r['daddr']}:{r['dport']} to port {r['sport']} {r['outcome']}"
                          + (f" after {r['age_ms']} ms, {r['retransmits']} SYN-ACK(s) sent again"
                             if r["outcome"] != "made" else "")),
    "synack_retransmit": lambda r: (f"SYN-ACK sent again from port {r['sport']} to {r['daddr']}:{r['dport']} "
                                    f"({r['retransmits']} before)"),
}
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
    for (k, f), default in ADDED.items():
        if k == kind and f not in rec:
            rec[f] = default
    for f, (t, top) in schema.items():         # a number past what its C type holds is not nettap's
        v = rec.get(f)
        if not isinstance(v, t) or isinstance(v, bool) or (t is int and not 0 <= v <= top):
            problems.add(f"{kind} record(s) with a missing or bad {f}", where)
            return None
    if kind in ("chunk", "dns"):
        if rec["direction"] not in DIRECTIONS:
            problems.add(f"{kind} record(s) with a bad direction", where)
            return None
        try:
            rec["data"] = base64.b64decode(rec["data"], validate=True)
        except (binascii.Error, ValueError):
            problems.add(f"{kind} record(s) whose data is not base64", where)
            return None
        if kind == "chunk" and len(rec["data"]) != rec["len"]:
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
        # TLS plaintext of the connection (chunks flagged tls: libssl's
        # calls on its socket), with offsets of its own; empty when none.
        self.tls: Dict[str, Stream] = {}
        self._keep = keep
        self.eof: Optional[dict] = None

    def add(self, rec: dict) -> None:
        self.pids.add(rec["pid"])
        self.first_ts = min(self.first_ts, rec["ts_ns"])
        if rec["type"] == "chunk":
            if "tls" in rec["flags"]:
                if not self.tls:
                    self.tls = {d: Stream(self._keep) for d in DIRECTIONS}
                self.tls[rec["direction"]].add(rec)
            else:
                self.streams[rec["direction"]].add(rec)
        else:
            self.eof = rec

    def total(self, direction: str) -> int:
        return self.eof[("tx_bytes", "rx_bytes")[DIRECTIONS.index(direction)]] if self.eof else 0

    def ends(self, direction: str) -> Tuple[str, str]:
        """(from, to) of the direction's bytes."""
        loc, rem = endpoint(self.family, self.saddr, self.sport), endpoint(self.family, self.daddr, self.dport)
        return (loc, rem) if direction == "egress" else (rem, loc)


def endpoint(family: str, addr: str, port: int) -> str:
    addr = escape(addr)                         # any string a file holds: shown, never obeyed
    return f"[{addr}]:{port}" if family == "ipv6" else f"{addr}:{port}"


def _key(rec: dict) -> tuple:
    return (rec["conn_id"], rec["family"], rec["saddr"], rec["sport"], rec["daddr"], rec["dport"])


class Capture:
    """Connections and record counts of a set of capture files."""

    def __init__(self) -> None:
        self.conns: Dict[tuple, Conn] = {}
        self.counts = dict.fromkeys(SCHEMAS, 0)
        self.clocks: List[Tuple[int, int, int]] = []      # (real_ns, kernel drops, lost after) per clock line
        self.clock_track: List[Tuple[int, int]] = []      # (ts_ns, real_ns) per clock line: wall time
        self.events: Dict[int, List[Tuple[int, str]]] = {}    # conn_id -> its life's (ts_ns, text), in order
        self.logs: Dict[str, int] = {}
        self.marks: List[Tuple[str, str, int]] = []   # (start or stop, time, pid) in file order
        self.no_conn = 0                        # chunks of connections nettap had no room for
        self.dns: List[dict] = []               # the dns records, in file order (nettap read --dns)
        self.samples: Dict[int, int] = {}       # capture.sample_connections -> owner records decided under it
        # Conn.key -> its owner's pod and container (owner lines): a conn_id
        # alone restarts at 1 with each nettap run
        self.pods: Dict[tuple, str] = {}
        self._portless: Dict[tuple, tuple] = {}  # key without the local port -> key
        self._portless_pods: Dict[tuple, str] = {}  # the same -> a pod of an owner line without its port yet

    def add(self, rec: dict, keep: bool = False) -> None:
        kind = rec["type"]
        self.counts[kind] += 1
        if kind == "log":
            self.logs[rec["code"]] = self.logs.get(rec["code"], 0) + 1
            return
        if kind == "dns":
            self.dns.append(rec)
            return
        if kind == "dlopen":                    # a library nettap saw a process load (capture.tls): counted
            return
        if kind in ("start", "stop"):
            self.marks.append((kind, rec["time"], rec["pid"]))
            return
        if kind == "clock":
            n = [sum(v for v in rec[k].values() if isinstance(v, int)) for k in ("drops", "lost")]
            self.clocks.append((rec["real_ns"], n[0], n[1]))
            self.clock_track.append((rec["ts_ns"], rec["real_ns"]))
            return
        if kind == "owner":
            self.samples[rec["sample"]] = self.samples.get(rec["sample"], 0) + 1
            if "pod_uid" in rec:
                self._owner_pod(_key(rec), rec["ts_ns"], pod_text(rec))
        if kind in LIFECYCLE:                   # a socket's life, by its conn_id
            self.events.setdefault(rec["conn_id"], []).append((rec["ts_ns"], escape(LIFECYCLE[kind](rec))))
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
            pod = self._portless_pods.pop(key[:3] + key[4:], None)
            if pod is not None and key not in self.pods:
                self.pods[key] = pod
        c.add(rec)

    def _owner_pod(self, key: tuple, ts_ns: int, pod: str) -> None:
        """An owner line's pod, for its connection. One made at a connect
        may lack the local port (tcp_v4_connect() sets TCP_SYN_SENT before
        inet_hash_connect() picks it): with sport 0 it is the pod of the
        connection read before without one whose records are not older than
        it (the rings are written to the file apart), else of the next one read."""
        if key[3] != 0:
            self.pods[key] = pod
            return
        known = self._portless.get(key[:3] + key[4:])
        if known is not None and known not in self.pods and self.conns[known].first_ts >= ts_ns:
            self.pods[known] = pod
        else:
            self._portless_pods[key[:3] + key[4:]] = pod


def select(conns, ports=(), pids=(), ids=()) -> List[Conn]:
    return [c for c in conns
            if (not ports or c.sport in ports or c.dport in ports)
            and (not pids or c.pids & set(pids))
            and (not ids or c.conn_id in ids)]
