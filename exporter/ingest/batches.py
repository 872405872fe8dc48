"""A region of a capture file, as messages: its lines grouped by record
kind, one message per kind, each a pure function of the file's bytes and
the region's ends. Sent again after a crash, a region gives the same
bytes under the same ids, and the engine's de-duplication drops them.
"""
from __future__ import annotations

import re
from typing import Dict, List

from exporter.ingest.files import FileId

INVALID = "invalid"          # lines that are not a record with a "type" (a cut line, garbage)
# The capture writes each record's keys in byte order: "type" is a key (a
# string value holds no unescaped quote) and one of the last.
_KIND = re.compile(rb'"type":"([A-Za-z0-9_-]{1,32})"')
_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def token(s: str) -> str:
    """s as one subject token and message-id field: [A-Za-z0-9_-] only."""
    return _TOKEN.sub("_", s) or "_"


class Message:
    __slots__ = ("region", "kind", "subject", "payload", "records", "msg_id", "headers", "token", "deadline",
                 "sends")

    def __init__(self, region, kind: str, subject: str, payload: bytes, records: int, msg_id: str,
                 headers: Dict[str, str]) -> None:
        self.region, self.kind, self.subject = region, kind, subject
        self.payload, self.records, self.msg_id, self.headers = payload, records, msg_id, headers
        self.token = ""
        self.deadline = 0.0
        self.sends = 0


class Region:
    """[start, end) of one file: complete lines, sent as messages."""

    __slots__ = ("fid", "start", "end", "messages", "pending", "records")

    def __init__(self, fid: FileId, start: int, end: int) -> None:
        self.fid, self.start, self.end = fid, start, end
        self.messages: List[Message] = []
        self.pending = 0                        # messages not acknowledged yet
        self.records = 0

    @property
    def done(self) -> bool:
        return self.pending == 0


def split(data: bytes) -> Dict[str, List[bytes]]:
    """data's lines (each ending in a newline) by kind, in file order."""
    groups: Dict[str, List[bytes]] = {}
    search = _KIND.search
    for line in data.splitlines(True):
        m = search(line)
        kind = m.group(1).decode() if m else INVALID
        g = groups.get(kind)
        if g is None:
            g = groups[kind] = []
        g.append(line if line[-1:] == b"\n" else line + b"\n")
    return groups


def region(fid: FileId, start: int, data: bytes, node: str, subject: str) -> Region:
    """The region of data read at start, as its messages. subject: the
    template, with {node} and {kind}."""
    r = Region(fid, start, start + len(data))
    where = f"{r.start}-{r.end}"
    for kind, lines in split(data).items():
        payload = b"".join(lines)
        headers = {"Nats-Msg-Id": f"{node}:{fid}:{where}:{kind}", "Nettap-Node": node, "Nettap-File": str(fid),
                   "Nettap-Region": where, "Nettap-Records": str(len(lines))}
        r.messages.append(Message(r, kind, subject.format(node=node, kind=kind), payload, len(lines),
                                  headers["Nats-Msg-Id"], headers))
        r.records += len(lines)
    r.pending = len(r.messages)
    return r


def subjects_pattern(subject: str) -> str:
    """The stream subject that takes every node's and kind's subject."""
    return subject.format(node="*", kind="*")
