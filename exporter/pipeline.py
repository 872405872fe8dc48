"""From rings to sink: the drain thread and the sink thread.

The drain thread only copies batches out of ring memory (no per-record
Python work), so the rings empty at memory speed; batches then wait in a
bounded queue for the sink thread, which formats JSON lines. When the sink
cannot keep up, whole batches are dropped at the queue and counted
(``lost['queue']``): the loss is in user space, visible, and the rings keep
draining. Every other place a record can be lost is counted too: kernel
reserve failures in the ringbuf_drops map, bad records in ``lost['decode']``,
failed writes in ``lost['sink']``.
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

log = logging.getLogger(__name__)


class Pipeline:
    """Owns the drain and sink threads. start() once, stop() once."""

    def __init__(self, rings: Dict[str, RingMemory], sink: Optional[Sink],
                 queue_records: int = 1 << 20, poll_interval: float = 0.05):
        self.rings = rings
        self.sink = sink
        self.queue_records = queue_records
        self.poll_interval = poll_interval
        self.poller = RingPoller(rings.values())
        self.lost = {"queue": 0, "decode": 0}
        self._queue: Deque[Batch] = collections.deque()
        self._queued = 0
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
        for ring in self.rings.values():
            while True:
                b = ring.read()
                if b is None:
                    break
                total += b.count
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
        with self._cv:
            if self._queued + len(b.records) > self.queue_records:
                self.lost["queue"] += len(b.records)
                return
            self._queue.append(b)
            self._queued += len(b.records)
            self._cv.notify()

    def _sink_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                b = self._queue.popleft()
                self._queued -= len(b.records)
            try:
                with self._sink_lock:
                    # One call formats the whole batch (compiled, without the
                    # interpreter lock, when built: records.jsonl).
                    self.sink.write_data(records.jsonl(b.ring, b.records), len(b.records))
            except Exception:
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
        self.poller.release()
        self.running = False
