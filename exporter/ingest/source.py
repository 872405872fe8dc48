"""A stream ingest wrote, read back as JSON lines: what `nettap read --nats`
and the tests read.

Ingest splits each region of a file by record kind, one message per kind.
Reading puts a node's lines back in its files' order: regions in the order
the stream holds them (ingest sends them in file order), the lines of one
region by their ts_ns (the order the kernel made them; stable, so lines of
one kind keep their file order).
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Dict, List, Tuple

from exporter.ingest.batches import INVALID

FETCH = 256                   # messages a pull asks for


class Message:
    __slots__ = ("seq", "subject", "headers", "data")

    def __init__(self, seq: int, subject: str, headers: Dict[str, str], data: bytes) -> None:
        self.seq, self.subject, self.headers, self.data = seq, subject, headers, data


async def fetch(nc, stream: str, timeout: float = 5.0, tries: int = 3) -> List[Message]:
    """Every message of stream stored when this starts, in stream order.
    Raises TimeoutError when the stream stops answering (tries fetches in
    a row time out) before its last message."""
    import nats.errors
    js = nc.jetstream(timeout=timeout)
    info = await js.stream_info(stream)
    last = info.state.last_seq
    out: List[Message] = []
    if not info.state.messages:
        return out
    sub = await js.pull_subscribe(">", stream=stream)
    failed = 0
    try:
        while not out or out[-1].seq < last:
            try:
                msgs = await sub.fetch(FETCH, timeout=timeout)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                failed += 1
                if failed >= tries:
                    raise TimeoutError(f"stream {stream}: no answer after message {out[-1].seq if out else 0} "
                                       f"of {last}") from None
                continue
            failed = 0
            for m in msgs:
                seq = m.metadata.sequence.stream
                out.append(Message(seq, m.subject, dict(m.headers or {}), m.data))
                await m.ack()
    finally:
        await sub.unsubscribe()
    return [m for m in out if m.seq <= last]


def lines(messages: List[Message]) -> Dict[str, List[bytes]]:
    """node -> its lines, in its files' order."""
    import json
    regions: "OrderedDict[Tuple[str, str, int], List[Tuple[int, bytes]]]" = OrderedDict()
    seen = set()
    for m in messages:
        h = m.headers
        node, fid, region = h.get("Nettap-Node", "?"), h.get("Nettap-File", "?"), h.get("Nettap-Region", "0-0")
        mid = h.get("Nats-Msg-Id")
        if mid is not None:
            # Stored twice (outside the engine's window): once here. Only the
            # same bytes: another publisher's message under a used id hides nothing.
            key = (mid, m.subject, hashlib.blake2b(m.data, digest_size=16).digest())
            if key in seen:
                continue
            seen.add(key)
        first = region.split("-")[0]
        start = int(first) if first.isascii() and first.isdigit() else 0     # not "²": isdigit() alone takes it
        got = regions.setdefault((node, fid, start), [])
        kind = m.subject.rsplit(".", 1)[-1]
        for line in m.data.splitlines(True):
            ts = -1
            if kind != INVALID:
                # Any publisher on the subjects can put any line here: one that
                # is no record keeps its place (ts -1) and is counted by the reader.
                try:
                    ts = int(json.loads(line).get("ts_ns", -1))
                except (ValueError, AttributeError, TypeError, OverflowError, RecursionError):
                    pass
            got.append((ts, line))
    out: Dict[str, List[bytes]] = {}
    order: Dict[Tuple[str, str], int] = {}
    for (node, _fid, _start), got in sorted(regions.items(), key=lambda kv: (_first(order, kv[0]), kv[0][2])):
        got.sort(key=lambda tl: tl[0])
        out.setdefault(node, []).extend(line for _, line in got)
    return out


def _first(order: Dict[Tuple[str, str], int], key: Tuple[str, str, int]) -> int:
    """Files in the order their first region appears in the stream."""
    return order.setdefault(key[:2], len(order))
