"""exporter.capture.pipeline over a real RingMemory (the ring's memory emulated in a
memfd, records written as the kernel lays them out): lines are formatted
in place, the queue is bounded in bytes, a full queue leaves records in
their ring, and only a sink slower for long loses records, in whole
batches, counted exactly and logged."""
from __future__ import annotations

import fcntl
import json
import mmap
import os
import re
import struct
import threading
import time

import numpy as np
import pytest

from exporter.capture import pipeline as pipeline_mod
from exporter.capture import records as R
from exporter.capture.pipeline import QUEUE_PARTS, Pipeline
from exporter.capture.ringbuf import RingMemory
from exporter.capture.sinks import Sink, StdoutSink
from exporter.capture.records import STRIDES
from tests.unit.test_jsonl import random_records
from tests import oracles
from tests.procs import wait_for

PAGE = mmap.PAGESIZE
RING = "capture_chunks"
SIZE = 64 << 10                   # 128 chunk slots
QUEUE = 16 << 10                  # the byte bound under test: 5 chunk records a read


class MemRing:
    """A ring buffer's memory as the kernel maps it (consumer page, producer
    page, data), in a memfd, with a producer that writes records the way
    bpf_ringbuf_submit does and counts what did not fit (the kernel's drops)."""

    def __init__(self, name=RING, size=SIZE, start=0):
        self.name, self.size, self.stride = name, size, STRIDES[name]
        self.rec = R.RECORDS[name]
        self.mfd = os.memfd_create("nettap-test-ring")
        os.ftruncate(self.mfd, 2 * PAGE + size)
        self.mem = mmap.mmap(self.mfd, 2 * PAGE + size)
        self.prod = start
        struct.pack_into("<Q", self.mem, 0, start)
        struct.pack_into("<Q", self.mem, PAGE, start)
        self.next_id = 0
        self.published = []               # conn_ids, in order
        self.dropped = 0
        self.ring = RingMemory(name, self.mfd, size, copy=False)
        # RingMemory maps the memfd; the poller needs a pollable fd: a pipe
        # that never becomes readable (the poll times out, or tests drain).
        self._r, self._w = os.pipe()
        self.ring.fd = self._r

    def pending(self) -> int:
        return self.prod - struct.unpack_from("<Q", self.mem, 0)[0]

    def publish(self, recs=None, n=0, flags=0) -> None:
        if recs is None:
            recs = np.zeros(n, self.rec)
        for r in recs:
            if self.size - self.pending() < self.stride:
                self.dropped += 1
                continue
            r = r.copy()
            r["kind"] = R.KINDS[self.name]
            r["conn_id"] = self.next_id
            self.next_id += 1
            off = 2 * PAGE + (self.prod & (self.size - 1))
            self.mem[off:off + 8] = struct.pack("<II", self.rec.itemsize | flags, 0)
            self.mem[off + 8:off + 8 + self.rec.itemsize] = r.tobytes()
            if not flags & R.RB_DISCARD:
                self.published.append(int(r["conn_id"]))
            self.prod += self.stride
        struct.pack_into("<Q", self.mem, PAGE, self.prod)      # commit

    def raw_slot(self, header: int) -> int:
        """Reserve one slot with this header (length | flags) and a zero
        record, as a program between reserve and commit (BUSY) or a record
        of a foreign size; returns its offset for commit()."""
        off = 2 * PAGE + (self.prod & (self.size - 1))
        length = header & ~(R.RB_BUSY | R.RB_DISCARD)
        # The kernel lays a record out at its own length, rounded to 8;
        # nettap's records fill their stride exactly.
        span = self.stride if length == self.rec.itemsize else (length + 8 + 7) // 8 * 8
        rec = np.zeros((), self.rec)
        rec["kind"] = R.KINDS[self.name]
        body = rec.tobytes()[:span - 8] if length == self.rec.itemsize else b""
        self.mem[off:off + span] = (struct.pack("<II", header, 0) + body).ljust(span, b"\0")
        self.prod += span
        struct.pack_into("<Q", self.mem, PAGE, self.prod)
        return off

    def commit(self, off: int) -> None:
        struct.pack_into("<I", self.mem, off, self.rec.itemsize)
        self.published.append(None)

    def close(self):
        self.ring.close()
        self.mem.close()
        for fd in (self.mfd, self._r, self._w):
            os.close(fd)


class SlowSink(Sink):
    """Keeps what it wrote; each write waits for `gate` (when given), then
    sleeps `delay`; samples the queue's bytes on every write."""

    name = "slow"

    def __init__(self, delay=0.0, gate=None):
        super().__init__()
        self.delay, self.gate = delay, gate
        self.entered = threading.Event()
        self.data = []
        self.pipeline = None
        self.seen_queued = []

    def _write(self, data):
        self.entered.set()
        if self.pipeline is not None:
            self.seen_queued.append(self.pipeline.queued_bytes)
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        self.data.append(data)

    @property
    def ids(self):
        lines = [json.loads(line) for d in self.data for line in d.splitlines()]
        return [r["conn_id"] for r in lines if r["type"] not in ("start", "stop", "clock")]


LOSS = re.compile(r"output queue full \(output\.queue_bytes: (\d+)\) and a ring half full: dropped (\d+) "
                  r"records in (\d+) whole batches \((\d+) since start\): the sink is slower than capture")


def losses_logged(caplog):
    return [tuple(int(x) for x in LOSS.fullmatch(r.getMessage()).groups())
            for r in caplog.records if r.name == "exporter.capture.pipeline" and LOSS.fullmatch(r.getMessage())]


@pytest.fixture
def mem():
    m = MemRing()
    yield m
    m.close()


def started(mem, sink, queue=QUEUE):
    """A pipeline whose drain thread only runs at stop (poll_interval 1 h):
    the test drains by hand."""
    p = Pipeline({mem.name: mem.ring}, sink, queue_bytes=queue, poll_interval=3600)
    if isinstance(sink, SlowSink):
        sink.pipeline = p
    p.start()
    return p


def test_lines_are_formatted_in_place_and_equal_the_reference():
    """Records of every extreme, wrapping round the ring's end, with a
    discarded one between: the sink gets exactly the reference writer's
    lines for the committed records, in order."""
    mem = MemRing(start=SIZE - 5 * STRIDES[RING])        # the sixth record wraps
    try:
        recs = random_records(RING, 40, 7)
        sink = SlowSink()
        p = started(mem, sink)
        mem.publish(recs[:10])
        mem.publish(recs[10:11], flags=R.RB_DISCARD)
        mem.publish(recs[11:])
        p.drain_once()
        p.stop()
        kept = np.concatenate([recs[:10], recs[11:]]).copy()
        kept["conn_id"] = [i for i in range(40) if i != 10]
        start, *middle, stop = sink.data                 # this run's first and last lines
        assert json.loads(start)["type"] == "start" and json.loads(stop)["type"] == "stop"
        assert json.loads(start)["ts_ns"] <= json.loads(stop)["ts_ns"]
        assert b"".join(middle) == oracles.reference_jsonl(RING, kept)
        assert sink.written == 39 and p.lost == {"queue": 0, "decode": 0}        # the marks not counted
    finally:
        mem.close()


def test_batches_fit_half_the_queue_at_their_longest_lines(mem):
    p = Pipeline({mem.name: mem.ring}, None, queue_bytes=QUEUE)
    for ring in R.RECORDS:
        n = p.batch_records(ring)
        assert n * R.LINE_MAX[ring] <= QUEUE // QUEUE_PARTS < (n + 1) * R.LINE_MAX[ring]
    p.stop()


def test_a_batch_takes_at_most_an_eighth_of_its_ring(mem):
    """A queue far larger than the ring (64 MiB against 64 KiB here, as 64
    MiB against the 8 MiB chunk ring in issue 31's storm): a read still
    takes an eighth of the ring, so the producer gets room back batch by
    batch, and a batch dropped at a full queue is an eighth of the ring."""
    p = Pipeline({mem.name: mem.ring}, None, queue_bytes=64 << 20)
    try:
        n = p.batch_records(RING)
        assert n == SIZE // 8 // mem.stride == 16
        mem.publish(n=100)
        assert mem.ring.read(n).count == n and mem.pending() == (100 - n) * mem.stride
    finally:
        p.stop()


def test_full_queue_leaves_records_in_the_ring_and_loses_none(mem, caplog):
    """The sink blocked: the queue fills to its bound, then the drain
    stops reading; the rest waits in the ring (under half of it), and is
    written in order once the sink moves."""
    caplog.set_level("WARNING", logger="exporter.capture.pipeline")
    gate = threading.Event()
    sink = SlowSink(gate=gate)
    p = started(mem, sink)
    try:
        n = p.batch_records(RING)
        mem.publish(n=n)
        p.drain_once()
        assert sink.entered.wait(10)             # the sink holds batch 0, blocked
        mem.publish(n=mem.size // mem.stride // 2)               # half the ring
        assert p.drain_once() is True            # stopped by the full queue
        assert not p._room() and p.queued_bytes <= QUEUE
        assert mem.pending() > 0 and p.lost["queue"] == 0
        left = mem.pending()
        assert p.drain_once() is True and mem.pending() == left  # nothing more read while full
    finally:
        gate.set()
        p.stop()
    assert sink.ids == mem.published and mem.pending() == 0
    assert p.lost["queue"] == 0 and losses_logged(caplog) == []
    assert max(sink.seen_queued) <= QUEUE and p.queued_bytes == 0


def test_sink_slower_for_long_loses_whole_batches_counted_and_logged(mem, caplog):
    """The sink blocked while the ring passes half full: the drain drops
    whole batches from the ring (never letting the kernel drop), counts and
    logs them; everything else is written, in order."""
    caplog.set_level("WARNING", logger="exporter.capture.pipeline")
    gate = threading.Event()
    sink = SlowSink(gate=gate)
    p = started(mem, sink)
    slots = mem.size // mem.stride
    try:
        n = p.batch_records(RING)
        mem.publish(n=n)
        p.drain_once()
        assert sink.entered.wait(10)
        for _ in range(6):                       # 6 half rings: the ring alone cannot hold them
            mem.publish(n=slots // 2)
            p.drain_once()
            assert mem.pending() * 2 <= mem.size
        lost = p.lost["queue"]
        assert lost > 0 and mem.dropped == 0
        assert losses_logged(caplog)[0][0] == QUEUE     # the first loss logged at once
    finally:
        gate.set()
        p.stop()
    assert mem.dropped == 0
    assert sink.written + p.lost["queue"] == len(mem.published)
    ids = sink.ids
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # each loss is a whole read: the gaps in what was written come in batches of n
    written = set(ids)
    gaps, run = [], 0
    for i in mem.published:
        if i in written:
            if run:
                gaps.append(run)
            run = 0
        else:
            run += 1
    assert gaps and all(g % n == 0 for g in gaps), gaps
    logged = losses_logged(caplog)
    assert sum(r for _, r, _, _ in logged) == p.lost["queue"]
    assert sum(b for _, _, b, _ in logged) == p.lost["queue"] // n
    assert logged[-1][3] == p.lost["queue"]


def test_stop_writes_what_is_left_in_the_ring(mem):
    """At stop the last drain waits for a slow sink rather than dropping."""
    sink = SlowSink(delay=0.005)
    p = started(mem, sink)
    mem.publish(n=mem.size // mem.stride)       # the whole ring: several queues' worth of lines
    p.stop()
    assert sink.ids == mem.published and p.lost["queue"] == 0


def test_drain_thread_keeps_up_with_a_producer(mem):
    """The real loop (woken by its timer): a producer writing batches while
    the sink is slightly slow; nothing is lost and the queue stays bounded."""
    sink = SlowSink(delay=0.001)
    p = Pipeline({mem.name: mem.ring}, sink, queue_bytes=QUEUE, poll_interval=0.002)
    sink.pipeline = p
    p.start()
    try:
        for _ in range(200):
            if mem.pending() * 4 < mem.size:
                mem.publish(n=8)
            time.sleep(0.001)
    finally:
        p.stop()
    assert mem.dropped == 0 and p.lost["queue"] == 0
    assert sink.ids == mem.published
    assert max(sink.seen_queued) <= QUEUE and p.queue_peak_bytes <= QUEUE


def test_clock_lines_count_every_drop_once_and_place_records_in_wall_time(mem):
    """Issue 26's clock track: about every clock_interval, and once more at
    stop, a clock line with both clocks read together and what the kernel
    dropped (and what was lost after the rings) since the line before: the
    lines' drops add up to the kernel's, whatever the moment they were read."""
    kernel = {"capture_chunks": 0, "logs": 0}
    sink = SlowSink()
    p = Pipeline({mem.name: mem.ring}, sink, queue_bytes=QUEUE, poll_interval=0.005,
                 drops=lambda: dict(kernel), clock_interval=0.02)
    p.start()
    try:
        for i in range(40):
            kernel["capture_chunks"] += i % 3
            kernel["logs"] += i % 7 == 0
            mem.publish(n=1)
            time.sleep(0.004)
    finally:
        p.stop()
    lines = [json.loads(line) for d in sink.data for line in d.splitlines()]
    clocks = [r for r in lines if r["type"] == "clock"]
    assert len(clocks) >= 4 and lines[-2] is clocks[-1] and lines[-1]["type"] == "stop"
    assert {k: sum(c["drops"][k] for c in clocks) for k in kernel} == kernel
    assert all(set(c["lost"]) == {"queue", "decode", "sink"} and not any(c["lost"].values()) for c in clocks)
    mono = [c["ts_ns"] for c in clocks]
    real = [c["real_ns"] for c in clocks]
    assert mono == sorted(mono) and real == sorted(real)
    assert all(abs((r - real[0]) - (m - mono[0])) < 50_000_000 for m, r in zip(mono, real))   # one pace
    assert all(list(c) == sorted(c) for c in clocks)                          # keys in byte order
    assert sink.ids == mem.published                                        # no record among them
    assert sink.written == len(mem.published)                               # clock lines count as none


def test_queue_bound_follows_a_reload(mem):
    """apply() changes pipeline.queue_bytes: the next reads use it."""
    p = Pipeline({mem.name: mem.ring}, None, queue_bytes=QUEUE)
    n = p.batch_records(RING)
    p.queue_bytes = 2 * QUEUE
    assert p.batch_records(RING) in (2 * n, 2 * n + 1)
    p.stop()


def test_failed_formatting_loses_the_batch_counted_not_the_ring(mem, monkeypatch, caplog):
    read = RingMemory.read

    def broken(self, n, lines=False, discard=False):
        if lines:
            raise MemoryError("boom")
        return read(self, n, lines, discard)
    monkeypatch.setattr(RingMemory, "read", broken)
    sink = SlowSink()
    p = started(mem, sink)
    mem.publish(n=10)
    p.drain_once()
    p.stop()
    assert p.lost["decode"] == 10 and mem.pending() == 0 and sink.written == 0
    assert caplog.text.count("records failed") == 1          # rate-limited
    assert "formatting 5 capture_chunks records failed (5 lost so far)" in caplog.text


def test_a_busy_record_stops_the_read_until_committed(mem):
    mem.publish(n=3)
    off = mem.raw_slot(mem.rec.itemsize | R.RB_BUSY)
    mem.publish(n=2)
    b = mem.ring.read(100, lines=True)
    assert b.count == 3 and b.data.count(b"\n") == 3 and not b.full
    assert mem.ring.read(100, lines=True) is None and mem.pending() == 3 * mem.stride
    mem.commit(off)
    b = mem.ring.read(100, lines=True)
    assert b.count == 3 and mem.pending() == 0 and mem.ring.drained == 6


def test_a_record_of_a_foreign_size_is_counted_bad_and_skipped(mem):
    mem.publish(n=2)
    mem.raw_slot(mem.rec.itemsize - 8)          # 496 bytes: the next records are off the stride
    mem.publish(n=2)
    got, bad = 0, 0
    while (b := mem.ring.read(100, lines=True)) is not None:
        got += b.count
        bad += b.bad
    assert (got, bad, mem.pending()) == (4, 1, 0)


def test_stop_does_not_wait_for_a_reader_that_stopped_reading(mem, monkeypatch, caplog):
    """Issue 11: `nettap | (sleep 1000)` held SIGTERM until SIGKILL. Stop
    gives the sink SINK_STOP_TIMEOUT, then counts what it could not write
    (the batch stuck in the pipe and the ones queued) as lost at the sink."""
    monkeypatch.setattr(pipeline_mod, "SINK_STOP_TIMEOUT", 0.5)
    r, w = os.pipe()                             # nobody reads r
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    sink = StdoutSink(w)
    p = Pipeline({mem.name: mem.ring}, sink, queue_bytes=QUEUE, poll_interval=0.01)
    caplog.set_level("ERROR", logger="exporter.capture.pipeline")
    p.start()
    try:
        mem.publish(n=6 * p.batch_records(RING))     # far more than 4 KiB of JSON lines
        assert wait_for(lambda: mem.ring.drained == len(mem.published) and sink._batch is not None)
        t = time.monotonic()
        p.stop()
        took = time.monotonic() - t
        assert 0.5 <= took < 2.5                 # the last drain's wait, then the sink's second
        lost = sink.lost
        assert lost > 0 and sink.written + lost + p.lost["queue"] == len(mem.published)
        assert [m.getMessage() for m in caplog.records] == [
            "sink stdout still blocked after 0.5 s at stop (a reader that stopped reading?): "
            f"{lost} records counted lost"]
    finally:
        os.close(r)                              # the stuck write ends (EPIPE) ...
    time.sleep(0.2)
    assert sink.lost == lost and sink.errors == 0   # ... and counts nothing twice
    os.close(w)



def test_the_data_pages_are_mapped_at_the_first_record(mem):
    # A mapped ring counts whole in the RSS (the kernel fills every page in
    # at mmap): a ring nothing was published to is never mapped.
    assert mem.ring.read(100, lines=True) is None and not mem.ring.mapped
    mem.publish(n=2)
    b = mem.ring.read(100, lines=True)
    assert mem.ring.mapped and b.count == 2 and mem.pending() == 0
