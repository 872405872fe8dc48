"""A region of a capture file, as messages: its lines grouped by record
kind, one message per kind, each a pure function of the file's bytes and
the region's ends. Sent again after a crash, a region gives the same
bytes under the same ids, and the engine's de-duplication drops them.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

from exporter.capture._jsonl import kind_split
from exporter.ingest.files import FileId

INVALID = "invalid"          # lines that are not a record with a "type" (a cut line, garbage)
# A line's kind: its last "type" key (the compiled kind_split's rule). The
# capture writes each record's keys in byte order, so "type" is one of the
# last; a string value holds no unescaped quote, so these bytes are a key.
_KIND = re.compile(rb'.*"type":"([A-Za-z0-9_-]{1,32})"[,}]', re.DOTALL)
_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def token(s: str) -> str:
    """s as one subject token and message-id field: [A-Za-z0-9_-] only."""
    return _TOKEN.sub("_", s) or "_"


class Message:
    __slots__ = ("region", "kind", "subject", "payload", "records", "msg_id", "headers", "token", "deadline")

    def __init__(self, region, kind: str, subject: str, payload: bytes, records: int, msg_id: str,
                 headers: Dict[str, str]) -> None:
        self.region, self.kind, self.subject = region, kind, subject
        self.payload, self.records, self.msg_id, self.headers = payload, records, msg_id, headers
        self.token = ""
        self.deadline = 0.0


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
    The compiled writer's kind_split gathers them (a region of one kind is
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


def region(fid: FileId, start: int, data, node: str, subject: str) -> Region:
    """The region of data (bytes or a memoryview of a read) read at start,
    as its messages; a payload may be a view of data. subject: the
    template, with {node} and {kind}."""
    r = Region(fid, start, start + len(data))
    where = f"{r.start}-{r.end}"
    for kind, (payload, n) in split(data).items():
        headers = {"Nats-Msg-Id": f"{node}:{fid}:{where}:{kind}", "Nettap-Node": node, "Nettap-File": str(fid),
                   "Nettap-Region": where, "Nettap-Records": str(n)}
        r.messages.append(Message(r, kind, subject.format(node=node, kind=kind), payload, n,
                                  headers["Nats-Msg-Id"], headers))
        r.records += n
    r.pending = len(r.messages)
    return r


def subjects_pattern(subject: str) -> str:
    """The stream subject that takes every node's and kind's subject."""
    return subject.format(node="*", kind="*")
