"""From rings to sink: the drain thread and the sink thread.

The drain thread only copies batches out of ring memory (no per-record
Python work), so the rings empty at memory speed; batches then wait in a
queue bounded in bytes (``queue_bytes``: the records' bytes as they sat in
the ring, so memory stays bounded whatever the payload size) for the sink
thread, which formats JSON lines. A batch read is at most a sixteenth of the
bound, so one always fits an empty queue. When the sink cannot keep up,
whole batches are dropped at the queue, counted (``lost['queue']``) and
logged (at most one line per 10 s, and a last one at stop): the loss is in
user space, visible, and the rings keep draining. Every other place a
record can be lost is counted too: kernel reserve failures in the
ringbuf_drops map, bad records in ``lost['decode']``, failed writes in
``lost['sink']``.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Deque, Dict, Optional

from . import records
from .ringbuf import Batch, RingMemory, RingPoller
from .sinks import Sink
from .tcp_h import STRIDES

log = logging.getLogger(__name__)

BATCH_FRACTION = 16          # a batch read is at most queue_bytes / 16
LOSS_LOG_INTERVAL = 10.0     # seconds between two log lines about queue losses


def batch_bytes(b: Batch) -> int:
    """The memory a queued batch holds: its records as ring slots."""
    return len(b.records) * STRIDES[b.ring]


class Pipeline:
    """Owns the drain and sink threads. start() once, stop() once."""

    def __init__(self, rings: Dict[str, RingMemory], sink: Optional[Sink],
                 queue_bytes: int = 4 << 20, poll_interval: float = 0.05):
        self.rings = rings
        self.sink = sink
        self.queue_bytes = queue_bytes           # may change at run time (config reload)
        self.poll_interval = poll_interval
        self.poller = RingPoller(rings.values())
        self.lost = {"queue": 0, "decode": 0}
        self._queue: Deque[Batch] = collections.deque()
        self.queued_bytes = 0
        self.queue_peak_bytes = 0                # the most ever queued (benchmarks, tests)
        self._unlogged = [0, 0]                  # queue losses not logged yet: records, batches
        self._loss_log_time = -LOSS_LOG_INTERVAL
        self._cv = threading.Condition()
        self._sink_lock = threading.Lock()       # held while the sink writes
        self._stopping = False
        self._drain_t = threading.Thread(target=self._drain_loop, name="nettap-drain", daemon=True)
        self._sink_t = threading.Thread(target=self._sink_loop, name="nettap-sink", daemon=True)
        self._log_times: Dict[int, float] = {}
        self.running = False

    @property
    def drained(self) -> Dict[str, int]:
        return {name: r.drained for name, r in self.rings.items()}

    def start(self) -> None:
        self._drain_t.start()
        if self.sink:
            records.announce_writer()
            self._sink_t.start()
        self.running = True

    def drain_once(self) -> int:
        """Read every ring until empty; returns records read."""
        total = 0
        cap = max(self.queue_bytes // BATCH_FRACTION, 1)
        for ring in self.rings.values():
            while True:
                b = ring.read(max(cap // STRIDES[ring.name], 1))
                if b is None:
                    break
                total += b.count
                if b.bad:
                    with self._cv:                  # the sink thread counts here too
                        self.lost["decode"] += b.bad
                if ring.name == "logs":
                    self._log_bpf_problems(b)
                if self.sink and len(b.records):
                    self._enqueue(b)
                if not b.full:                      # caught up (or at a BUSY record)
                    break
        return total

    def _drain_loop(self) -> None:
        while self.poller.wait(self.poll_interval):
            try:
                self.drain_once()
            except Exception:                       # never let the drain die silently
                log.exception("drain failed; continuing")
                time.sleep(self.poll_interval)
        self.drain_once()                           # what is left at stop

    def _enqueue(self, b: Batch) -> None:
        n = batch_bytes(b)
        with self._cv:
            if self.queued_bytes + n <= self.queue_bytes:
                self._queue.append(b)
                self.queued_bytes += n
                self.queue_peak_bytes = max(self.queue_peak_bytes, self.queued_bytes)
                self._cv.notify()
                return
            self.lost["queue"] += len(b.records)
            self._unlogged[0] += len(b.records)
            self._unlogged[1] += 1
        now = time.monotonic()
        if now - self._loss_log_time >= LOSS_LOG_INTERVAL:
            self._loss_log_time = now
            self._log_queue_losses()

    def _log_queue_losses(self) -> None:
        records_, batches = self._unlogged
        if not records_:
            return
        self._unlogged = [0, 0]
        log.warning("output queue full (output.queue_bytes: %d): dropped %d records in %d whole batches "
                    "(%d since start): the sink is slower than capture", self.queue_bytes, records_, batches,
                    self.lost["queue"])

    def _sink_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                b = self._queue.popleft()
                self.queued_bytes -= batch_bytes(b)
            try:
                with self._sink_lock:
                    # One call formats the whole batch (compiled, without the
                    # interpreter lock, when built: records.jsonl).
                    self.sink.write_data(records.jsonl(b.ring, b.records), len(b.records))
            except Exception:
                with self._cv:
                    self.lost["decode"] += len(b.records)
                log.exception("formatting %d %s records failed", len(b.records), b.ring)

    def replace_sink(self, sink: Sink) -> None:
        """Swap the sink (same kind: file or stdout) between two batches."""
        with self._sink_lock:
            old, self.sink = self.sink, sink
            if old:
                old.close()

    def _log_bpf_problems(self, b: Batch) -> None:
        now = time.monotonic()
        for code in set(b.records["code"].tolist()):
            if now - self._log_times.get(code, 0) > 10:
                self._log_times[code] = now
                n = int((b.records["code"] == code).sum())
                log.warning("BPF programs reported %s (%d in this batch)",
                            records.LOG_CODES.get(code, code), n)

    def stop(self) -> None:
        """Stop both threads after a last drain, and flush the sink."""
        if not self.running:
            self.poller.release()
            return
        self.poller.close()
        self._drain_t.join()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self.sink:
            self._sink_t.join()
            self.sink.close()
        self._log_queue_losses()                    # what the rate limit held back
        self.poller.release()
        self.running = False
