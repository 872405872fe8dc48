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

Every record starts with nettap's own header (bpf/tcp.h, struct nettap_hdr),
whose kind says which record it is; a ring carries the kinds records.MASKS
gives it. A batch is read by one call into the compiled scan
(exporter/capture/scan.c, ``scan``), without the interpreter lock and with
no Python per record: it counts the records, formats their JSON lines in
place, or copies them out (from a ring of one kind). A record whose kind is
not the ring's, or whose length is not its kind's size (garbage, a stale
object), is counted bad and skipped by its own length, so the walk
resynchronises; the rare record that crosses the end of the data pages is
copied whole before it is read. A read stops at
the first record still BUSY and the caller comes back on its next poll,
rather than chasing the producer record by record. (The plain Python walk
the scan is checked against is tests/oracles.py's.)

Memory ordering, the same on every architecture: the kernel advances
``producer_pos`` with ``smp_store_release`` after it reserved a record (its
header BUSY), publishes the record by clearing BUSY with ``xchg`` after
writing it, and reads ``consumer_pos`` with ``smp_load_acquire`` before it
reuses space (kernel/bpf/ringbuf.c, ``__bpf_ringbuf_reserve`` and
``bpf_ringbuf_commit``). The reader takes the other half of each pair, as
libbpf's own reader does (src/ringbuf.c, ``ringbuf_process_ring``, behind
``ring_buffer__consume``): a load-acquire of ``producer_pos`` before any
header, a load-acquire of each record's header before its body, and a
store-release of ``consumer_pos`` after the last read of what it releases.
All three are C11 atomics in the compiled reader (``positions``, ``scan``
and ``release`` of exporter/capture/scan.c), never plain Python loads and
stores of the mapped pages: on x86-64 they compile to plain moves (TSO
gives the ordering), on arm64 to ``ldar`` and ``stlr``, and elsewhere to
whatever the compiler's memory model needs. The positions are the kernel's
``unsigned long``: 64 bits on every architecture nettap has objects for
(exporter/kernel/arch.py says which).

Thread-safety: a RingMemory is read by one thread at a time (the drain
thread). :meth:`RingPoller.close` may be called from any thread.
"""
from __future__ import annotations

import array
import mmap
import select
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

from exporter.capture import records
from exporter.capture.records import KIND_NAMES, MASKS
from exporter.util.wakeup import Wakeup

_COUNT, _LINES, _COPY = records.compiled.SCAN_COUNT, records.compiled.SCAN_LINES, records.compiled.SCAN_COPY
_FULL = 2                                       # its stop: max_records reached
_positions, _release = records.compiled.positions, records.compiled.release


@dataclass
class Batch:
    ring: str
    records: Any               # a numpy array of the ring's record dtype when copied, else None
    count: int = -1            # records read (== len(records) when copied)
    bad: int = 0               # records whose header did not match the layout
    full: bool = False         # max_records were read: more may be waiting
    data: bytes = b""          # their JSON lines, from read(lines=True)


class RingMemory:
    """The mapped memory of one ring. Reads records; never waits."""

    def __init__(self, name: str, map_fd: int, size: int, copy: bool = True):
        self.name = name
        self.fd = map_fd                           # what RingPoller polls
        self._map_fd = map_fd                      # what the data pages are mapped from
        self.size = size
        self.mask = size - 1
        self.one_kind = name in KIND_NAMES         # a copy needs one record dtype
        if size & (size - 1):
            raise ValueError(f"ring {name}: size {size} is not a power of two")
        page = mmap.PAGESIZE
        # consumer_pos and producer_pos, each at the start of its page: read
        # and written only by the compiled positions() and release().
        self._cons_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod_map = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        # The data pages are mapped at the first record (_map_data): the
        # kernel fills in every page of a ring's mapping at mmap time
        # (remap_vmalloc_range), so a mapped ring counts whole in nettap's
        # RSS, used or not (8 MiB for the chunk ring), and a ring nothing
        # is published to (a capture not asked for) is never mapped.
        self._data_map: Optional[mmap.mmap] = None
        self._data: Optional[memoryview] = None
        self.kinds = MASKS[name]
        self.drained = 0
        self.kind_drained = array.array("Q", bytes(8 * records.KINDS_MAX))   # by kind number
        self.bad = 0
        self.copy = copy     # False: records are counted and released, not copied out

    def _map_data(self) -> None:
        # The kernel maps the data pages twice in a row so that a record
        # crossing the end reads contiguously; nettap maps them once (the
        # second mapping would double the ring's share of nettap's RSS) and
        # the scan copies the rare record that crosses the end.
        page = mmap.PAGESIZE
        self._data_map = mmap.mmap(self._map_fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=2 * page)
        self._data = memoryview(self._data_map)

    @property
    def mapped(self) -> bool:
        """Are the data pages mapped (has a record arrived)?"""
        return self._data is not None

    def positions(self) -> Tuple[int, int]:
        """(consumer_pos, producer_pos), load-acquired."""
        return _positions(self._cons_map, self._prod_map)

    def pending_bytes(self) -> int:
        cons, prod = self.positions()
        return prod - cons

    def read(self, max_records: int = 1 << 16, lines: bool = False, discard: bool = False) -> Optional[Batch]:
        """Take the committed records after consumer_pos (at most
        max_records, stopping at the first record still BUSY), then release
        them to the producer. None when there is nothing committed.

        What is kept of them: with ``lines``, their JSON lines
        (``Batch.data``), formatted in place from ring memory before the ring
        is released; with ``discard``, nothing (they are counted); otherwise
        a copy when the ring was made with ``copy``."""
        cons, prod = self.positions()
        if prod == cons:
            return None
        if self._data is None:
            self._map_data()
        mode = _LINES if lines else _COUNT if discard or not self.copy or not self.one_kind else _COPY
        data, consumed, kept, bad, stop = records.compiled.scan(
            self.kinds, self._data, cons & self.mask, prod - cons, max_records, mode, self.kind_drained)
        if not consumed:                               # a BUSY record first
            return None
        _release(self._cons_map, cons + consumed)      # store-release: after the scan's reads
        self.drained += kept
        self.bad += bad
        recs = _copied(self.name, data) if mode == _COPY else None
        return Batch(self.name, recs, count=kept, bad=bad, full=stop == _FULL,
                     data=data if mode == _LINES else b"")

    def close(self) -> None:
        # Release the view before unmapping.
        if self._data is not None:
            self._data.release()
            self._data_map.close()
            self._data = self._data_map = None
        self._cons_map.close()
        self._prod_map.close()


def _copied(ring: str, data: bytes):
    """A copied batch as a numpy array of its ring's record dtype (numpy is
    imported here, at the first copy: never by an idle nettap)."""
    import numpy as np
    return np.frombuffer(data, dtype=records.RECORDS[ring])


class RingPoller:
    """Waits for data on several rings. :meth:`close` (any thread) wakes a
    waiting :meth:`wait`, which then returns False."""

    def __init__(self, rings: Iterable[RingMemory]):
        self.rings: Dict[int, RingMemory] = {r.fd: r for r in rings}
        self._ep = select.epoll()
        self._wakeup = Wakeup()
        self._ep.register(self._wakeup.fileno(), select.EPOLLIN)
        # Edge-triggered: a ring polls readable for as long as it holds any
        # data (kernel/bpf/ringbuf.c, ringbuf_map_poll_user), so level-
        # triggered epoll would spin on a busy ring and drain it in crumbs.
        # Edge-triggered, only the producer's explicit wakeups (nettap's
        # programs force one once a quarter of that ring is pending, each
        # ring against its own size: exporter.capture.filter.wakeup_thresholds) end a wait
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
        self._wakeup.wake()

    def release(self) -> None:
        """Free the epoll and wake-up fds (after the waiting thread has left)."""
        self._ep.close()
        self._wakeup.close()
