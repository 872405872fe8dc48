"""Reading BPF ring buffers (BPF_MAP_TYPE_RINGBUF) from user space, in batches.

Two layers, after cilium/ebpf's ring reader: :class:`RingMemory` reads the
ring's memory (positions and records, no waiting); :class:`RingPoller` waits
for any of several rings to have data (epoll on the map fds, plus a wake-up
fd so :meth:`RingPoller.close` unblocks a waiting :meth:`RingPoller.wait`).

Ring memory (kernel/bpf/ringbuf.c, ``bpf_ringbuf_mmap_user``): page 0 holds
``consumer_pos`` and is the only page user space may write; page 1 holds
``producer_pos``; the data pages follow (mapped twice in a row by the kernel
so that a record crossing the end reads contiguously; nettap maps them once,
see :class:`RingMemory`). Each record starts
with an 8-byte header: u32 ``len`` whose bit 31 (BUSY) is set while the
producer still fills the record and bit 30 (DISCARD) when it was discarded,
and u32 ``pg_off``. Records are 8-byte aligned.

Every record nettap's programs write to one ring has the same size, and each
stride divides the ring size, so the records between the consumer and the
producer are one strided numpy array: a batch is read with one fancy index,
its headers checked as vectors, and no Python runs per record. A header that
does not fit the stride (garbage) sends that batch down :func:`walk`, the
record-by-record path, which resynchronises on the header lengths. A read
stops at the first record still BUSY and the caller comes back on its next
poll, rather than chasing the producer record by record.

Memory ordering: the kernel publishes a record by clearing BUSY with
``xchg`` after writing it, and advances ``producer_pos`` with
``smp_store_release``; it reads ``consumer_pos`` with ``smp_load_acquire``.
On x86-64 (TSO) loads are not reordered with older loads and stores are not
reordered with older loads, so plain loads of ``producer_pos`` then of the
headers and data, followed by a plain store of ``consumer_pos`` after the
copy, give the acquire/release pairing the protocol needs. On a weakly
ordered architecture (arm64, ppc64, riscv) this reader would need a load
acquire of ``producer_pos`` and of each header (``ldar``), and a store
release of ``consumer_pos`` (``stlr``), which plain numpy loads and stores do
not give; nettap's loader therefore only runs this reader on x86-64.

Thread-safety: a RingMemory is read by one thread at a time (the drain
thread). :meth:`RingPoller.close` may be called from any thread.
"""
from __future__ import annotations

import functools
import mmap
import os
import platform
import select
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from . import records
from .records import RB_BUSY, RB_DISCARD, RB_HDR, RECORDS, SLOTS

_EMPTY = {ring: np.empty(0, dtype=rec) for ring, rec in RECORDS.items()}

_LEN_MASK = ~(RB_BUSY | RB_DISCARD) & 0xFFFFFFFF


@dataclass
class Batch:
    ring: str
    records: np.ndarray        # structured array of the ring's record dtype (empty when not copied)
    count: int = -1            # records read (== len(records) when copied)
    bad: int = 0               # records whose header did not match the layout
    full: bool = False         # max_records were read: more may be waiting
    data: bytes = b""          # what read(fmt=...) made of the records (their JSON lines)


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


class RingMemory:
    """The mapped memory of one ring. Reads records; never waits."""

    def __init__(self, name: str, map_fd: int, size: int, copy: bool = True):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(f"ring reader: memory ordering is only proven on x86-64, not {platform.machine()}")
        self.name = name
        self.fd = map_fd
        self.size = size
        self.mask = size - 1
        self.record = RECORDS[name]
        self.slot = SLOTS[name]
        if size % self.slot.itemsize:
            raise ValueError(f"ring {name}: size {size} is not a multiple of its stride {self.slot.itemsize}")
        page = mmap.PAGESIZE
        self._cons_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # The kernel maps the data pages twice in a row so that a record
        # crossing the end reads contiguously; nettap's strides divide the
        # ring, so no record crosses it and one mapping is enough (the
        # second would only double the ring's share of nettap's RSS).
        self._prod_map = mmap.mmap(map_fd, page + size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._cons = np.frombuffer(self._cons_map, dtype=np.uint64, count=1)
        self._prod = np.frombuffer(self._prod_map, dtype=np.uint64, count=1)
        self._data = memoryview(self._prod_map)[page:page + size]
        self._slots = np.frombuffer(self._prod_map, dtype=self.slot, count=size // self.slot.itemsize, offset=page)
        # The same memory as rows of raw bytes: copying rows is one memcpy,
        # where copying structured items goes field by field.
        self._rows = np.frombuffer(self._prod_map, dtype=np.uint8, count=size, offset=page).reshape(-1, self.slot.itemsize)
        self.drained = 0
        self.bad = 0
        self.copy = copy     # False: records are counted and released, not copied out

    def positions(self) -> Tuple[int, int]:
        return int(self._cons[0]), int(self._prod[0])

    def pending_bytes(self) -> int:
        cons, prod = self.positions()
        return prod - cons

    def read(self, max_records: int = 1 << 16, lines: bool = False, discard: bool = False) -> Optional[Batch]:
        """Take the committed records after consumer_pos (at most
        max_records slots, stopping at the first record still BUSY), then
        release them to the producer. None when there is nothing committed.

        What is kept of them: with ``lines``, their JSON lines
        (``Batch.data``), formatted in place from ring memory before the ring
        is released: nothing is copied; with ``discard``, nothing (they are
        counted); otherwise a copy when the ring was made with ``copy``.
        The compiled scan (exporter/_jsonl.c) does lines and counting in one
        pass without the interpreter lock; numpy does it when it is not built."""
        cons, prod = self.positions()
        if prod == cons:
            return None
        if (lines or discard or not self.copy) and records.compiled() is not None \
                and not (prod - cons) % self.slot.itemsize and not cons % self.slot.itemsize:
            return self._read_compiled(cons, prod, max_records, lines)
        fmt = functools.partial(records.jsonl, self.name) if lines else None
        stride = self.slot.itemsize
        if (prod - cons) % stride or cons % stride:
            return self._read_walk(cons, prod, fmt)
        n = min((prod - cons) // stride, max_records)
        first = (cons & self.mask) // stride
        nslots = len(self._slots)
        # Views, no copy yet: the pending records wrap at most once.
        spans = [(first, min(first + n, nslots))]
        if first + n > nslots:
            spans.append((0, first + n - nslots))
        hdr = np.concatenate([self._slots["rb_len"][a:b] for a, b in spans]) if len(spans) > 1 \
            else self._slots["rb_len"][spans[0][0]:spans[0][1]]
        busy = np.flatnonzero(hdr & RB_BUSY)
        if busy.size:                                  # stop at the first uncommitted record
            n = int(busy[0])
            if n == 0:
                return None
            hdr = hdr[:n]
            a0, b0 = spans[0]
            spans = [(a0, min(b0, a0 + n))] + ([(0, n - (b0 - a0))] if n > b0 - a0 else [])
        keep = (hdr & RB_DISCARD) == 0
        all_kept = bool(keep.all())
        if not ((hdr & _LEN_MASK) == self.record.itemsize)[keep].all():
            return self._read_walk(cons, prod, fmt)
        count = n if all_kept else int(keep.sum())
        recs, data = _EMPTY[self.name], b""
        if discard:
            pass
        elif fmt is not None:
            parts, at = [], 0
            for a, b in spans:
                view = self._slots["rec"][a:b]
                if not all_kept:
                    view = view[keep[at:at + b - a]]
                at += b - a
                parts.append(fmt(view))
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        elif self.copy:
            rows = np.concatenate([self._rows[a:b] for a, b in spans])     # the copy
            recs = rows.view(self.slot).reshape(-1)["rec"]
            if not all_kept:
                recs = recs[keep]
        self._cons[0] = cons + n * stride              # release (x86-64: plain store)
        self.drained += count
        return Batch(self.name, recs, count=count, full=n == max_records, data=data)

    def _read_compiled(self, cons: int, prod: int, max_records: int, lines: bool) -> Optional[Batch]:
        stride = self.slot.itemsize
        data, consumed, kept, stop = records.compiled().scan(
            records.KINDS[self.name], self._data, cons & self.mask, prod - cons, stride, max_records, lines)
        if stop == 2 and not consumed:                 # a record of another size first: walk
            return self._read_walk(cons, prod, functools.partial(records.jsonl, self.name) if lines else None)
        if not consumed:                               # a BUSY record first
            return None
        self._cons[0] = cons + consumed                # release (x86-64: plain store)
        self.drained += kept
        return Batch(self.name, _EMPTY[self.name], count=kept, full=consumed == max_records * stride,
                     data=data or b"")

    def _read_walk(self, cons: int, prod: int, fmt=None) -> Optional[Batch]:
        start = cons & self.mask
        end = start + min(prod - cons, self.size)
        buf = self._data[start:end] if end <= self.size else \
            bytes(self._data[start:self.size]) + bytes(self._data[:end - self.size])
        recs, bad, pos = walk(buf, self.record)
        pos += start
        if pos == start:
            return None
        data = fmt(recs) if fmt is not None and len(recs) else b""
        self._cons[0] = cons + (pos - start)
        self.drained += len(recs)
        self.bad += bad
        return Batch(self.name, recs, count=len(recs), bad=bad, data=data)

    def close(self) -> None:
        # Drop numpy views before unmapping.
        self._cons = self._prod = self._slots = self._rows = None
        self._data.release()
        self._cons_map.close()
        self._prod_map.close()


class RingPoller:
    """Waits for data on several rings. :meth:`close` (any thread) wakes a
    waiting :meth:`wait`, which then returns False."""

    def __init__(self, rings: Iterable[RingMemory]):
        self.rings: Dict[int, RingMemory] = {r.fd: r for r in rings}
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._ep.register(self._wake_r, select.EPOLLIN)
        # Edge-triggered: a ring polls readable for as long as it holds any
        # data (kernel/bpf/ringbuf.c, ringbuf_map_poll_user), so level-
        # triggered epoll would spin on a busy ring and drain it in crumbs.
        # Edge-triggered, only the producer's explicit wakeups (nettap's
        # programs force one once a quarter of that ring is pending, each
        # ring against its own size: exporter.targets.wakeup_thresholds) end a wait
        # early; otherwise the caller's timeout paces the drain.
        for fd in self.rings:
            self._ep.register(fd, select.EPOLLIN | select.EPOLLET)
        self.closed = False

    def wait(self, timeout: float) -> bool:
        """Block until a ring signals data or timeout seconds pass; False once closed."""
        if self.closed:
            return False
        try:
            self._ep.poll(timeout)
        except InterruptedError:
            pass
        return not self.closed

    def close(self) -> None:
        self.closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def release(self) -> None:
        """Free the epoll and pipe fds (after the waiting thread has left)."""
        self._ep.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
