"""exporter.pipeline: the queue between drain and sink is bounded in bytes;
when the sink is slower than capture, whole batches are lost there, counted
exactly and logged (rate-limited, and the remainder at stop)."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from exporter import pipeline as pipeline_mod
from exporter.pipeline import Pipeline
from exporter.records import RECORDS
from exporter.ringbuf import Batch
from exporter.sinks import Sink

STRIDE = 512                      # a chunk record in the ring
QUEUE = 64 << 10                  # the byte bound under test
PER_BATCH = QUEUE // pipeline_mod.BATCH_FRACTION // STRIDE      # 8 records a read


class FakeRing:
    """Stands for RingMemory: records numbered by conn_id, read in order."""

    def __init__(self, name="capture_chunks"):
        self.name = name
        self.fd, self._w = os.pipe()            # never readable: the poll times out
        self.drained = 0
        self.produced = 0
        self.reads = []
        self._lock = threading.Lock()

    def add(self, n):
        with self._lock:
            self.produced += n

    def read(self, max_records=1 << 16):
        with self._lock:
            n = min(self.produced - self.drained, max_records)
            if n == 0:
                return None
            recs = np.zeros(n, dtype=RECORDS[self.name])
            recs["conn_id"] = np.arange(self.drained, self.drained + n)
            self.drained += n
        self.reads.append(n)
        return Batch(self.name, recs, count=n, full=n == max_records)

    def close(self):
        os.close(self.fd)
        os.close(self._w)


class SlowSink(Sink):
    """Keeps the conn_ids it wrote; each write waits for `gate` (when set
    up), then sleeps `delay`; samples the queue's bytes on every write."""

    name = "slow"

    def __init__(self, delay=0.0, gate=None):
        super().__init__()
        self.delay = delay
        self.gate = gate
        self.entered = threading.Event()
        self.ids = []
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
        self.ids += [json.loads(l)["conn_id"] for l in data.splitlines()]


LOSS = re.compile(r"output queue full \(output\.queue_bytes: (\d+)\): dropped (\d+) records in (\d+) whole "
                  r"batches \((\d+) since start\): the sink is slower than capture")


def losses_logged(caplog):
    return [tuple(int(x) for x in LOSS.fullmatch(r.getMessage()).groups())
            for r in caplog.records if r.name == "exporter.pipeline" and LOSS.fullmatch(r.getMessage())]


@pytest.fixture
def ring():
    r = FakeRing()
    yield r
    r.close()


def test_batches_are_capped_to_a_fraction_of_the_queue(ring):
    p = Pipeline({"capture_chunks": ring}, None, queue_bytes=QUEUE)
    ring.add(100)
    assert p.drain_once() == 100
    assert ring.reads == [8] * 12 + [4]
    p.stop()


def test_full_queue_loses_whole_batches_counted_and_logged(ring, caplog):
    gate = threading.Event()
    sink = SlowSink(gate=gate)
    p = Pipeline({"capture_chunks": ring}, sink, queue_bytes=QUEUE, poll_interval=3600)
    sink.pipeline = p
    caplog.set_level("WARNING", logger="exporter.pipeline")
    p.start()
    try:
        ring.add(PER_BATCH)
        p.drain_once()
        assert sink.entered.wait(10)            # the sink holds batch 0, blocked
        ring.add(40 * PER_BATCH)                # 40 more batches: 16 fit the queue
        p.drain_once()
        fit = QUEUE // (PER_BATCH * STRIDE)
        assert fit == 16
        assert p.queued_bytes == p.queue_peak_bytes == QUEUE
        assert p.lost["queue"] == (40 - fit) * PER_BATCH
        # the first loss is logged at once; the rest wait for the rate limit
        assert losses_logged(caplog) == [(QUEUE, PER_BATCH, 1, PER_BATCH)]
    finally:
        gate.set()
        p.stop()
    lost = (40 - fit) * PER_BATCH
    assert losses_logged(caplog) == [(QUEUE, PER_BATCH, 1, PER_BATCH),
                                     (QUEUE, lost - PER_BATCH, 40 - fit - 1, lost)]
    # the oldest batches were written, in order; the later ones lost whole
    assert sink.ids == list(range((1 + fit) * PER_BATCH))
    assert sink.written + p.lost["queue"] == ring.drained == 41 * PER_BATCH
    assert p.queued_bytes == 0


def test_slow_sink_never_exceeds_the_byte_bound(ring, caplog):
    """A producer faster than the sink for a while: the queue stays within
    its bound, every record is written or lost (in whole batches), and the
    loss is logged."""
    sink = SlowSink(delay=0.01)
    p = Pipeline({"capture_chunks": ring}, sink, queue_bytes=QUEUE, poll_interval=0.002)
    sink.pipeline = p
    caplog.set_level("WARNING", logger="exporter.pipeline")
    p.start()
    try:
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            ring.add(4 * PER_BATCH)              # ~4 batches per ms: far above the sink's rate
            time.sleep(0.001)
    finally:
        p.stop()
    assert ring.drained == ring.produced
    assert 0 < p.queue_peak_bytes <= QUEUE
    assert max(sink.seen_queued) <= QUEUE
    lost = p.lost["queue"]
    assert lost > 0 and lost % PER_BATCH == 0
    assert sink.written + lost == ring.produced
    written = set(sink.ids)
    assert len(written) == len(sink.ids) == sink.written
    for start in range(0, ring.produced, PER_BATCH):       # each batch: all written or all lost
        got = len(written & set(range(start, start + PER_BATCH)))
        assert got in (0, PER_BATCH), (start, got)
    logged = losses_logged(caplog)
    assert 1 <= len(logged) <= 2                 # 0.6 s: the first loss, then the rest at stop
    assert sum(n for _, n, _, _ in logged) == lost
    assert sum(b for _, _, b, _ in logged) == lost // PER_BATCH
    assert logged[-1][3] == lost


def test_queue_bound_follows_a_reload(ring):
    """apply() changes pipeline.queue_bytes: the next reads and the next
    enqueue use it."""
    gate = threading.Event()
    sink = SlowSink(gate=gate)
    p = Pipeline({"capture_chunks": ring}, sink, queue_bytes=QUEUE, poll_interval=3600)
    p.start()
    try:
        ring.add(PER_BATCH)
        p.drain_once()
        assert sink.entered.wait(10)
        p.queue_bytes = 2 * QUEUE                # batches of 16 records now; 16 fit
        ring.add(40 * PER_BATCH)
        p.drain_once()
        assert ring.reads[1:] == [2 * PER_BATCH] * 20
        assert p.queued_bytes == 2 * QUEUE
        assert p.lost["queue"] == 4 * 2 * PER_BATCH
    finally:
        gate.set()
        p.stop()


class SlowLen(np.ndarray):
    """Records whose len() lets other threads run (as a GIL switch there would)."""

    def __len__(self):
        time.sleep(0.0002)
        return super().__len__()


class BadRing(FakeRing):
    """Every read: one good record (queued for the sink) and one bad one."""

    def read(self, max_records=1 << 16):
        b = super().read(1)
        if b is not None:
            b.records, b.bad, b.full = b.records.view(SlowLen), 1, False
        return b


class FailingSink(SlowSink):
    def write_data(self, data, count):
        raise RuntimeError("formatting failed")


def test_decode_losses_from_both_threads_all_counted(monkeypatch):
    """lost['decode'] grows in the drain thread (bad records) and in the sink
    thread (a batch that failed to format): no increment may be lost."""
    import logging
    logging.getLogger("exporter.pipeline").disabled = True
    ring = BadRing()
    p = Pipeline({"capture_chunks": ring}, FailingSink(), queue_bytes=1 << 30, poll_interval=30)
    try:
        p._sink_t.start()
        p.running = True
        n = 2_000
        ring.add(n)
        for _ in range(n):
            p.drain_once()
    finally:
        with p._cv:
            p._stopping = True
            p._cv.notify()
        p._sink_t.join(30)
        logging.getLogger("exporter.pipeline").disabled = False
        ring.close()
    assert p.lost["decode"] == 2 * n            # n bad records + n records that failed to format
