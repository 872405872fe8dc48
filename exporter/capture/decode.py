"""``nettap --decode``: raw ring records from a file or device to JSON lines.

The input is read in bounded pieces, never whole: it may be a device or a
pipe that never ends (``/dev/zero``). It is ring memory as
kernel/bpf/ringbuf.c lays it out (8-byte header ``{u32 len, u32 pg_off}``,
the record, padding to 8 bytes), but a file can hold anything: a record cut
short in the middle (a dump spliced from two reads), records of another
ring, or bytes that are no records at all. Unlike :func:`ringbuf.walk`,
which trusts each header's length (ring memory is written by the kernel),
this decoder checks that a record ends where another one, or the input,
begins; where that fails it resynchronises on the next header of the
ring's record size, so one cut record or a stretch of garbage costs only
itself. Each is reported with its offset and counted.

What counts as a record: a record header (bpf/tcp.h, struct nettap_hdr) of
one of the ring's kinds, behind a ring header whose length is that kind's
size (DISCARD records are records the kernel dropped: skipped silently). A header
of another plausible length that lands on a record is a record of the wrong
length (bad). A zero header is not a record: nettap's programs never commit
one, and a ring's unused memory and ``/dev/zero`` are zeros; garbage like any
other.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, List, Optional, Tuple

import numpy as np

from exporter.capture.records import DTYPES, KIND_FIELD, NUMBERS, RB_BUSY, RB_DISCARD, RB_HDR, RING_KINDS

READ_SIZE = 1 << 20          # bytes read at a time
# Longest length a header of a wrong-length record may claim. nettap's
# records are under 1 KiB; anything longer is treated as garbage, so a bad
# header cannot make the decoder skip (or buffer) much input.
MAX_LEN = 1 << 16
# A stretch of input this long without one record is not ring records of
# this ring (or is endless zeros): stop there rather than read on forever.
GARBAGE_MAX = 1 << 20
# Bytes the decoder looks ahead of a position before deciding about it.
_AHEAD = 2 * (RB_HDR + MAX_LEN) + 64

_LEN_MASK = ~(RB_BUSY | RB_DISCARD) & 0xFFFFFFFF


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class Result:
    records: int = 0          # good records decoded
    bad: int = 0              # bad stretches: wrong length, cut short, garbage
    gave_up: bool = False     # stopped after GARBAGE_MAX bytes without a record
    offset: int = 0           # bytes of input consumed


class Decoder:
    """Streams one ring's records out of a binary file object.

    ``records(f)`` yields (kind, numpy array) of good records, in input
    order: a run of one kind at a time, per piece read; each problem is
    passed to ``report(offset, message)`` as it is found, and counted in
    :attr:`result`.
    """

    def __init__(self, ring: str, report: Callable[[int, str], None], read_size: int = READ_SIZE,
                 garbage_max: int = GARBAGE_MAX):
        self.ring = ring
        off, width = KIND_FIELD
        self._kind_at = (RB_HDR + off, RB_HDR + off + width)
        # the kind number as bytes -> (kind, record size), for the ring's kinds
        self._kinds = {NUMBERS[k].to_bytes(width, "little"): (k, DTYPES[k].itemsize) for k in RING_KINDS[ring]}
        self._sizes = {size for _, size in self._kinds.values()}
        self.size = "/".join(str(n) for n in sorted(self._sizes))      # for messages
        self.report = report
        self.read_size = read_size
        self.garbage_max = garbage_max
        self.result = Result()

    # -- headers, in the buffered window buf (base = its offset in the input) --

    def _len(self, buf, p: int) -> Optional[int]:
        """The header at p's length, None if BUSY or past the window."""
        if p + RB_HDR > len(buf):
            return None
        h = int.from_bytes(buf[p:p + 4], "little")
        return None if h & RB_BUSY else h & _LEN_MASK

    def _valid(self, buf, p: int) -> bool:
        """A ring header at p whose length is the size of the kind its record
        header names, a kind of this ring (unless the input ends before the
        kind: then of any of its kinds' sizes, a record cut short)."""
        n = self._len(buf, p)
        if n not in self._sizes:
            return False
        kind = buf[p + self._kind_at[0]:p + self._kind_at[1]]
        if len(kind) < self._kind_at[1] - self._kind_at[0]:
            return True
        return self._kinds.get(bytes(kind), (None, None))[1] == n

    def _step(self, buf, p: int) -> int:
        """Bytes the record at p takes: its ring header, itself, padding."""
        return _align(RB_HDR + self._len(buf, p))

    def _wrong_len(self, buf, p: int, eof: bool) -> bool:
        """A header of another plausible length that ends where a record or the input begins."""
        n = self._len(buf, p)
        if n is None or n == 0 or n > MAX_LEN:
            return False
        nxt = p + _align(RB_HDR + n)
        return (eof and nxt == len(buf)) or self._valid(buf, nxt)

    def _fits(self, buf, p: int, eof: bool) -> bool:
        """Whether p is where the input ends or something decodable begins."""
        return (eof and p == len(buf)) or self._valid(buf, p) or self._wrong_len(buf, p, eof)

    def _resync(self, buf, start: int, stop: int, eof: bool) -> Optional[int]:
        """First record in [start, stop) that is followed by something decodable.

        Any byte offset: a file cut or spliced at any byte puts the records
        after it off the 8-byte grid. bytes.find does the scan (in C)."""
        stop = min(stop, len(buf))
        heads = [h for n in self._sizes for h in (n.to_bytes(4, "little"), (n | RB_DISCARD).to_bytes(4, "little"))]
        while start < stop:
            q = min((i for i in (buf.find(h, start, stop + 3) for h in heads) if i >= 0), default=-1)
            if q < 0 or q >= stop:
                return None
            # A length found in the last 7 bytes is no whole header (a
            # record cut there is reported as trailing bytes).
            if self._len(buf, q) is not None and self._fits(buf, q + self._step(buf, q), eof):
                return q
            start = q + 1
        return None

    def _body(self, buf, p: int) -> Tuple[bytes, bytes]:
        """(kind number bytes, record) of the record at p."""
        return bytes(buf[p + self._kind_at[0]:p + self._kind_at[1]]), buf[p + RB_HDR:p + RB_HDR + self._len(buf, p)]

    def records(self, f: BinaryIO) -> Iterator[Tuple[str, np.ndarray]]:
        r = self.result
        buf = b""
        eof = False
        while not eof or buf:
            if not eof:
                piece = f.read(self.read_size)
                eof = not piece
                buf += piece
            good: List[Tuple[bytes, bytes]] = []
            p = 0
            # Decide only with _AHEAD bytes in view (or the whole rest).
            while p + RB_HDR <= len(buf) and (eof or p + _AHEAD <= len(buf)):
                at = r.offset + p
                if self._valid(buf, p):
                    n = self._len(buf, p)
                    nxt = p + _align(RB_HDR + n)
                    if nxt <= len(buf) and self._fits(buf, nxt, eof):
                        if not int.from_bytes(buf[p:p + 4], "little") & RB_DISCARD:
                            good.append(self._body(buf, p))
                        p = nxt
                        continue
                    # A good header followed by nothing decodable: either
                    # this record was cut and another starts inside it, or
                    # what follows is garbage (the next turn's problem).
                    q = self._resync(buf, p + 8, nxt, eof)
                    if q is not None:
                        r.bad += 1
                        self.report(at, f"record cut short ({q - p - RB_HDR} of {n} bytes)")
                        p = q
                    elif nxt > len(buf):
                        r.bad += 1
                        self.report(at, f"record cut short by the end of input "
                                        f"({len(buf) - p - RB_HDR} of {n} bytes)")
                        p = len(buf)
                    else:
                        if not int.from_bytes(buf[p:p + 4], "little") & RB_DISCARD:
                            good.append(self._body(buf, p))
                        p = nxt
                    continue
                if self._wrong_len(buf, p, eof):
                    n = self._len(buf, p)
                    r.bad += 1
                    self.report(at, f"record of {n} bytes, not {self.size}: skipped" if n not in self._sizes
                                else f"record of {n} bytes of another kind than {self.ring}'s: skipped")
                    p += _align(RB_HDR + n)
                    continue
                # Only positions with _AHEAD bytes after them are judged.
                view_end = len(buf) if eof else len(buf) - _AHEAD
                q = self._resync(buf, p + 8, min(p + self.garbage_max, view_end), eof)
                if q is None and view_end < p + self.garbage_max:
                    if not eof:
                        break                       # read more before judging
                    r.bad += 1
                    self.report(at, f"{len(buf) - p} byte(s) at the end are not records")
                    p = len(buf)
                elif q is None:
                    r.bad += 1
                    self.report(at, f"no {self.size}-byte record in the {self.garbage_max} bytes from here: "
                                    f"stopped (is this {self.ring} records?)")
                    r.gave_up = True
                    break
                else:
                    r.bad += 1
                    self.report(at, f"{q - p} byte(s) are not records")
                    p = q
            if eof and RB_HDR > len(buf) - p > 0:
                r.bad += 1
                self.report(r.offset + p, f"{len(buf) - p} trailing byte(s) are not a whole record header")
                p = len(buf)
            r.offset += p
            buf = buf[p:]
            r.records += len(good)
            for number, run in itertools.groupby(good, key=lambda g: g[0]):     # in input order
                kind = self._kinds[number][0]
                yield kind, np.frombuffer(b"".join(body for _, body in run), dtype=DTYPES[kind])
            if r.gave_up:
                return
