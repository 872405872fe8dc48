"""A region of a capture file, as messages: its lines grouped by record
kind, one message per kind, each a pure function of the file's bytes and
the region's ends. Sent again after a crash, a region gives the same
bytes under the same ids, and the engine's de-duplication drops them.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

from exporter.ingest._split import KIND_NAME_MAX, kind_split
from exporter.ingest.files import FileId

INVALID = "invalid"          # lines that are not a record with a "type" (a cut line, garbage)
# A line's kind: its last "type" key (the compiled kind_split's rule). The
# capture writes each record's keys in byte order, so "type" is one of the
# last; a string value holds no unescaped quote, so these bytes are a key.
_KIND = re.compile(rb'.*"type":"([A-Za-z0-9_-]{1,%d})"[,}]' % KIND_NAME_MAX, re.DOTALL)
_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
# An owner message's Nettap-Pods header (docs/kubernetes.md): the pods its lines name, so that a
# consumer of nettap.<node>.owner can pick a pod's connections by header. Its value is at most
# PODS_MAX characters (header_room counts them); a pod's keys are the owner line's texts.
PODS_MAX = 1024
_POD_KEYS = tuple(re.compile(rb'"%s":"([^"\\]*)"' % k) for k in (b"namespace", b"pod", b"container"))
_NOT_NAME = re.compile(r"[^A-Za-z0-9._-]")


def token(s: str) -> str:
    """s as one subject token and message-id field: [A-Za-z0-9_-] only."""
    return _TOKEN.sub("_", s) or "_"


class Message:
    __slots__ = ("region", "kind", "subject", "payload", "records", "msg_id", "headers", "token", "deadline", "span")

    def __init__(self, region, kind: str, subject: str, payload: bytes, records: int, msg_id: str,
                 headers: Dict[str, str], span: Tuple[int, int] = None) -> None:
        self.region, self.kind, self.subject = region, kind, subject
        self.payload, self.records, self.msg_id, self.headers = payload, records, msg_id, headers
        self.token = ""
        self.deadline = 0.0
        self.span = span or (region.start, region.end)     # its lines are the kind's of [start, end) of the file


class Region:
    """[start, end) of one file: complete lines, sent as messages."""

    __slots__ = ("fid", "start", "end", "messages", "pending", "records")

    def __init__(self, fid: FileId, start: int, end: int) -> None:
        self.fid, self.start, self.end = fid, start, end
        self.messages: List[Message] = []
        self.pending = 0                        # messages not acknowledged yet
        self.records = 0                        # lines, all kinds

    @property
    def done(self) -> bool:
        return self.pending == 0


def split(data) -> Dict[str, Tuple[bytes, int]]:
    """data's lines (each ending in a newline; bytes or a memoryview) by
    kind, in file order: per kind, its lines as one payload and how many.
    The compiled kind_split (exporter/ingest/_split.c) gathers them (a region of one kind is
    its own payload, not copied); a region with a line that has no kind (a
    line that is not a record) goes line by line."""
    groups = kind_split(data)
    if groups is None:
        return _split_lines(data)
    if len(groups) == 1:
        return {groups[0][0].decode(): (data, groups[0][2])}
    return {kind.decode(): (payload, n) for kind, payload, n in groups}


def _split_lines(data) -> Dict[str, Tuple[bytes, int]]:
    groups: Dict[str, List[bytes]] = {}
    match = _KIND.match
    for line in bytes(data).splitlines(True):
        m = match(line)
        kind = m.group(1).decode() if m else INVALID
        groups.setdefault(kind, []).append(line if line[-1:] == b"\n" else line + b"\n")
    return {k: (b"".join(v), len(v)) for k, v in groups.items()}


def pods(payload) -> str:
    """The Nettap-Pods header of a message of owner lines: each pod its lines name as
    namespace/pod/container (namespace/pod without a container's name), distinct and sorted,
    comma-separated, cut after the last whole one within PODS_MAX (then ",..."); "" where no
    line names a pod (no kubelet: ids only)."""
    data = bytes(payload)
    if b'"pod":"' not in data:
        return ""
    seen = set()
    for line in data.split(b"\n"):
        if b'"pod":"' in line:
            ns, pod, c = (_NOT_NAME.sub("_", m.group(1).decode("utf-8", "replace")) if m else ""
                          for m in (k.search(line) for k in _POD_KEYS))
            seen.add(f"{ns}/{pod}/{c}" if c else f"{ns}/{pod}")
    out = ""
    for p in sorted(seen):
        if len(out) + len(p) + 1 > PODS_MAX - 4:
            return out + ",..."
        out = f"{out},{p}" if out else p
    return out


def region(fid: FileId, start: int, data, node: str, subject: str) -> Region:
    """The region of data (bytes or a memoryview of a read) read at start,
    as its messages; a payload may be a view of data. subject: the
    template, with {node} and {kind}."""
    r = Region(fid, start, start + len(data))
    where = f"{r.start}-{r.end}"
    for kind, (payload, n) in split(data).items():
        headers = _headers(r, where, kind, node, n, pods(payload) if kind == "owner" else "")
        r.messages.append(Message(r, kind, subject.format(node=node, kind=kind), payload, n,
                                  headers["Nats-Msg-Id"], headers))
        r.records += n
    r.pending = len(r.messages)
    return r


def header_bytes(headers: Dict[str, str]) -> int:
    """The bytes headers take in a message: the server counts them in
    its max_payload, and JetStream in a stream's max_msg_size."""
    return len(b"NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def header_room(node: str, fid: FileId, kind: str = "k" * 32) -> int:
    """At most the bytes of the headers of a message of a region of fid
    (the longest offsets and record count; a kind the longest _KIND takes;
    an owner message's, with the longest Nettap-Pods: one too large for its
    region's limit is sent in parts, as any)."""
    most = 10 ** 19
    r = Region(fid, most, most)
    return header_bytes(_headers(r, f"{most}-{most}", kind, node, most, "p" * PODS_MAX if kind == "owner" else ""))


def _headers(r: Region, where: str, kind: str, node: str, n: int, pods_: str = "") -> Dict[str, str]:
    h = {"Nats-Msg-Id": f"{node}:{r.fid}:{where}:{kind}", "Nettap-Node": node, "Nettap-File": str(r.fid),
         "Nettap-Region": f"{r.start}-{r.end}", "Nettap-Records": str(n)}
    if pods_:
        h["Nettap-Pods"] = pods_
    return h


def parts(m: Message, data, node: str, most: int) -> Tuple[List[Message], int]:
    """m (whose span's bytes data are) as messages of at most most bytes
    of lines each: (the parts, the lines longer than most, in none). A part
    holds m's kind's lines of [a, b) of the file, and its id names them as a
    region [a, b) cut so would (its lines of that kind, whoever cut it): the
    same limit cuts the same parts again after a restart, under the same
    ids. Nettap-Region stays m's region's."""
    r, out, lost = m.region, [], 0
    a, at, got, size = m.span[0], m.span[0], [], 0

    def part(b: int) -> None:
        payload = b"".join(got)
        headers = _headers(r, f"{a}-{b}", m.kind, node, len(got), pods(payload) if m.kind == "owner" else "")
        out.append(Message(r, m.kind, m.subject, payload, len(got), headers["Nats-Msg-Id"], headers, (a, b)))
    data = bytes(data)
    for line in (data[i:j] for i, j in _lines(data)):
        k = _KIND.match(line)
        if (k.group(1).decode() if k else INVALID) == m.kind:
            whole = line if line[-1:] == b"\n" else line + b"\n"
            if len(whole) > most:
                lost += 1
            else:
                if got and size + len(whole) > most:
                    part(at)
                    a, got, size = at, [], 0
                got.append(whole)
                size += len(whole)
        at += len(line)
    if got:
        part(m.span[1])
    return out, lost


def _lines(data: bytes):
    """(start, end) of each line of data (the last may lack its newline)."""
    at = 0
    while at < len(data):
        nl = data.find(b"\n", at)
        end = len(data) if nl < 0 else nl + 1
        yield at, end
        at = end


def subjects_pattern(subject: str) -> str:
    """The stream subject that takes every node's and kind's subject."""
    return subject.format(node="*", kind="*")
