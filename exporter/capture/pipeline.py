"""From rings to sink: the drain thread and the sink thread.

The drain thread reads each ring in place and, when there is a sink, has
the compiled writer turn the records into JSON lines straight from ring
memory (records.jsonl, without the interpreter lock), then releases them
to the kernel: no copy, and no per-record Python work. The lines wait in a
queue bounded in bytes (``queue_bytes``) for the sink thread, which only
writes them. So a slow disk or a stalled stdout reader never holds the
rings, and formatting never waits for the interpreter lock held by
another thread.

When the queue is full, the drain leaves the records in their ring (the
ring is the larger buffer, and its pages are resident anyway) and waits
for the sink; only when a ring is also more than half full does it drop a
whole batch from that ring unformatted, counted (``lost['queue']``) and
logged (at most one line per 10 s, and a last one at stop): the loss is
in user space, visible, and the kernel never has to drop. Every other
place a record can be lost is counted too: kernel reserve failures in the
ringbuf_drops map, bad records in ``lost['decode']``, failed writes in
``lost['sink']``.

Each ring is drained when its producer wakes the reader (a quarter of the
ring pending: exporter.capture.filter.wakeup_thresholds; the segments and
dns rings' programs take a quarter of their ring's size themselves) or every
``poll_interval`` (the latency of a quiet ring's records), whichever comes
first.

The clock track: about once a second (and once more at stop) the drain
writes a ``clock`` line: CLOCK_MONOTONIC (``ts_ns``, the records' clock) and
CLOCK_REALTIME (``real_ns``) read together, and what each ring dropped in the
kernel (``drops``) and what was lost after the rings (``lost``) since the last
clock line, so a reader can place records in wall time and void a window
that lost some. Like the start and stop lines, it is no record: counted in
no record metric.
"""
from __future__ import annotations

import collections
import ctypes
import json
import logging
import threading
import time
import traceback
from typing import Callable, Deque, Dict, Optional, Tuple

from exporter.capture import records
from exporter.capture.ringbuf import Batch, RingMemory, RingPoller
from exporter.capture.sinks import Sink, mark_line

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.2          # s: records of a quiet ring reach the sink within this
QUEUE_PARTS = 2              # a batch's longest possible lines fill at most queue_bytes / 2
RING_PARTS = 8               # a batch takes at most an eighth of its ring
RING_HIGH = 2                # queue full: a ring more than 1/RING_HIGH full loses a batch
WAIT_FOR_SINK = 0.005        # s the drain waits for the sink before looking at the rings again
LOSS_LOG_INTERVAL = 10.0     # s between two log lines about queue losses
CLOCK_INTERVAL = 1.0         # s between two clock lines
# How long stop waits for the sink to take what is left in the rings and
# write what is queued: well inside the time a supervisor gives before
# SIGKILL (docker 10 s, Kubernetes 30 s). What does not make it is counted.
SINK_STOP_TIMEOUT = 5.0


def _name_os_thread(name: str) -> None:
    """Give the running thread its name in the kernel too (top -H, ps -L,
    /proc/PID/task/*/comm), so what the drain and the sink cost is seen
    apart. Python 3.11 names only its own Thread objects."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)     # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class Pipeline:
    """Owns the drain and sink threads. start() once, stop() once."""

    def __init__(self, rings: Dict[str, RingMemory], sink: Optional[Sink],
                 queue_bytes: int = 4 << 20, poll_interval: float = POLL_INTERVAL,
                 drops: Optional[Callable[[], Dict[str, int]]] = None, clock_interval: float = CLOCK_INTERVAL,
                 watch: Optional[Dict[str, Callable[[object], None]]] = None,
                 edit: Optional[Dict[str, Callable[[bytes], bytes]]] = None):
        """watch: ring -> a function the drain thread gives each batch of that
        ring's records (a numpy array, copied out of the ring), before they
        are formatted: the rings user space acts on (logs always). edit: ring
        -> a function given each batch of that ring's JSON lines, returning
        them as they are to be written (kubelines: the owner lines' pods);
        may change at run time."""
        self.edit: Dict[str, Callable[[bytes], bytes]] = dict(edit or {})
        self.edit_failures = 0                   # batches written as formatted because their edit failed
        self.rings = rings
        self.watch: Dict[str, Callable[[object], None]] = {"logs": self._log_bpf_problems, **(watch or {})}
        self._drops = drops                      # ring -> records the kernel dropped, since load
        self.clock_interval = clock_interval
        self._clock_next = 0.0
        self._clock_last: Dict[str, Dict[str, int]] = {"drops": {}, "lost": {}}
        self.sink = sink
        self.queue_bytes = queue_bytes           # may change at run time (config reload)
        self.poll_interval = poll_interval
        self.poller = RingPoller(rings.values())
        self.lost = {"queue": 0, "decode": 0}
        self._queue: Deque[Tuple[bytes, int]] = collections.deque()     # (lines, records)
        self.queued_bytes = 0
        self.queue_peak_bytes = 0                # the most ever queued (benchmarks, tests)
        self._unlogged = [0, 0]                  # queue losses not logged yet: records, batches
        self._loss_log_time = -LOSS_LOG_INTERVAL
        self._cv = threading.Condition()
        self._sink_lock = threading.Lock()       # held while the sink writes
        self._stopping = False
        self._stop_deadline = 0.0
        self._drain_t = threading.Thread(target=self._drain_loop, name="nettap-drain", daemon=True)
        self._sink_t = threading.Thread(target=self._sink_loop, name="nettap-sink", daemon=True)
        self._log_times: Dict[object, float] = {}
        self.running = False

    @property
    def drained(self) -> Dict[str, int]:
        return {name: r.drained for name, r in self.rings.items()}

    def start(self) -> None:
        if self.sink:                               # before any record: the first line of this run
            self._enqueue(mark_line("start"), 0)
        self._drain_t.start()
        if self.sink:
            self._sink_t.start()
        self.running = True

    def batch_records(self, ring: str) -> int:
        """Records a read takes: their longest possible lines fit the queue's
        free half (records.LINE_MAX), so the queue never exceeds queue_bytes;
        and they fill at most an eighth of their ring (records.STRIDES). A
        read releases its records to the kernel only once their lines are
        made: a batch of a whole ring (a large queue took one: 64 MiB
        queue_bytes, 8 MiB chunk ring) left the producer no room while it was
        formatted, and a batch dropped at a full queue lost the whole ring."""
        n = self.queue_bytes // QUEUE_PARTS // records.LINE_MAX[ring]
        r = self.rings.get(ring)
        if r is not None and ring in records.STRIDES:
            n = min(n, r.size // RING_PARTS // records.STRIDES[ring])
        return max(n, 1)

    def _room(self) -> bool:
        return self.queued_bytes <= self.queue_bytes - self.queue_bytes // QUEUE_PARTS

    def drain_once(self, deadline: Optional[float] = None) -> bool:
        """Read every ring until it is empty or the queue is full; returns
        True when a full queue left records in a ring. With a deadline (the
        last drain at stop), waits for the sink until then instead, and drops
        what still does not fit (counted)."""
        waiting = False
        for ring in self.rings.values():
            while True:
                n = self.batch_records(ring.name)
                if self.sink is None and ring.name in self.edit:
                    # no sink, but the pods' counts asked (metrics.kubernetes_labels): formatted for
                    # the edit that counts them, then dropped
                    b = self._read_lines(ring, n)
                    if b is not None and b.data:
                        self._edited(ring.name, b.data)
                        b.data = b""
                elif self.sink is None:
                    b = ring.read(n)                    # counted (and logs kept), not formatted
                elif self._room() or self._wait_for_room(deadline):
                    b = ring.read(n) if ring.name in self.watch else self._read_lines(ring, n)
                    if b is not None and b.data and ring.name in self.edit:
                        b.data = self._edited(ring.name, b.data)
                elif deadline is None and ring.pending_bytes() * RING_HIGH <= ring.size:
                    waiting = True                      # leave them in the ring for now
                    break
                else:
                    b = ring.read(n, discard=True)
                    if b is not None:
                        self._lose(b.count)
                if b is None:
                    break
                if b.bad:
                    with self._cv:                  # one lock for every count scrapes read
                        self.lost["decode"] += b.bad
                if ring.name in self.watch and b.records is not None and b.count:
                    self._watched(ring.name, b.records)
                    if self.sink:
                        b.data = self._format_copied(ring.name, b.records)
                if b.data:
                    self._enqueue(b.data, b.count)
                if not b.full:                      # caught up (or at a BUSY record)
                    break
        return waiting

    def _read_lines(self, ring: RingMemory, n: int) -> Optional[Batch]:
        """A read that formats; if formatting fails, the batch is read again
        without (lost, counted), so a failure never holds the ring."""
        try:
            return ring.read(n, lines=True)
        except Exception:
            b = ring.read(n, discard=True)
            self._format_failed(ring.name, b.count if b else 0)
            return b

    def _edited(self, ring: str, data: bytes) -> bytes:
        """The ring's edit of data; data as it is if the edit fails (counted, logged)."""
        try:
            return self.edit[ring](data)
        except Exception:
            self.edit_failures += 1
            now = time.monotonic()
            if now - self._log_times.get(("edit", ring), -LOSS_LOG_INTERVAL) >= LOSS_LOG_INTERVAL:
                self._log_times[("edit", ring)] = now
                log.error("editing %s lines failed (written as formatted): %s", ring, traceback.format_exc().rstrip())
            return data

    def _watched(self, ring: str, recs) -> None:
        """A watched ring's batch to its function, which must not stop the drain."""
        try:
            self.watch[ring](recs)
        except Exception:
            now = time.monotonic()
            if now - self._log_times.get(("watch", ring), -LOSS_LOG_INTERVAL) >= LOSS_LOG_INTERVAL:
                self._log_times[("watch", ring)] = now
                log.error("acting on %s records failed: %s", ring, traceback.format_exc().rstrip())

    def _format_copied(self, ring: str, recs) -> bytes:
        try:
            return records.jsonl(ring, recs)
        except Exception:
            self._format_failed(ring, len(recs))
            return b""

    def _format_failed(self, ring: str, count: int) -> None:
        with self._cv:
            self.lost["decode"] += count
        now = time.monotonic()
        if now - self._log_times.get("format", -LOSS_LOG_INTERVAL) >= LOSS_LOG_INTERVAL:
            self._log_times["format"] = now
            # The traceback as text: a kept exc_info would hold a view of
            # ring memory, and the ring could not unmap.
            log.error("formatting %d %s records failed (%d lost so far): %s", count, ring,
                      self.lost["decode"], traceback.format_exc().rstrip())

    def _wait_for_room(self, deadline: Optional[float]) -> bool:
        """At stop only: wait for the sink to make room until the deadline."""
        if deadline is None:
            return False
        with self._cv:
            while not self._room():
                left = deadline - time.monotonic()
                if left <= 0 or not self._sink_t.is_alive():
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def _drain_loop(self) -> None:
        _name_os_thread("nettap-drain")
        waiting = False
        while True:
            if waiting:                             # the queue was full: wait for the sink
                with self._cv:
                    if not self._room():
                        self._cv.wait(WAIT_FOR_SINK)
                if self.poller.closed:
                    break
            elif not self.poller.wait(self.poll_interval):
                break
            try:
                waiting = self.drain_once()
                if time.monotonic() >= self._clock_next:
                    self._clock_next = time.monotonic() + self.clock_interval
                    self._clock()
            except Exception:                       # never let the drain die silently
                log.exception("drain failed; continuing")
                time.sleep(self.poll_interval)
        self.drain_once(deadline=self._stop_deadline)      # what is left at stop
        try:
            self._clock()                           # the last window's count, before the stop line
        except Exception:
            log.exception("the last clock line failed")

    def _clock(self) -> None:
        """Queue a clock line (the module's docstring), when there is a sink
        and the kernel's drops can be read."""
        if not self.sink or self._drops is None:
            return
        mono = time.monotonic_ns()
        real = time.time_ns()
        mono = (mono + time.monotonic_ns()) // 2        # the instant real was read, within their gap
        drops = dict(self._drops())
        with self._cv:
            now = {"drops": drops, "lost": {**self.lost, "sink": self.sink.lost}}
        since = {k: {n: v - self._clock_last[k].get(n, 0) for n, v in sorted(now[k].items())} for k in now}
        self._clock_last = now
        line = {"drops": since["drops"], "lost": since["lost"], "real_ns": real, "ts_ns": mono, "type": "clock"}
        self._enqueue(json.dumps(line, separators=(",", ":")).encode() + b"\n", 0)

    def _enqueue(self, data: bytes, count: int) -> None:
        with self._cv:
            self._queue.append((data, count))
            self.queued_bytes += len(data)
            self.queue_peak_bytes = max(self.queue_peak_bytes, self.queued_bytes)
            self._cv.notify_all()

    def _lose(self, count: int) -> None:
        with self._cv:
            self.lost["queue"] += count
            self._unlogged[0] += count
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
        log.warning("output queue full (output.queue_bytes: %d) and a ring half full: dropped %d records "
                    "in %d whole batches (%d since start): the sink is slower than capture", self.queue_bytes,
                    records_, batches, self.lost["queue"])

    def _sink_loop(self) -> None:
        _name_os_thread("nettap-sink")
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                data, count = self._queue.popleft()
                self.queued_bytes -= len(data)
                self._cv.notify_all()               # room for the drain
            if not count:                           # a start or stop line (sinks.mark_line)
                with self._sink_lock:
                    self.sink.write_mark(data)
                continue
            try:
                with self._sink_lock:
                    self.sink.write_data(data, count)     # counts its own failures
            except Exception:
                self.sink.lost += count
                log.exception("sink %s failed on %d records", self.sink.name, count)

    def replace_sink(self, sink: Sink) -> None:
        """Swap the sink (same kind: file or stdout) between two batches."""
        with self._sink_lock:
            old, self.sink = self.sink, sink
            if old:
                old.close()

    def _log_bpf_problems(self, recs) -> None:
        now = time.monotonic()
        for code in set(recs["code"].tolist()):
            if now - self._log_times.get(code, 0) > 10:
                self._log_times[code] = now
                n = int((recs["code"] == code).sum())
                log.warning("BPF programs reported %s (%d in this batch)",
                            records.LOG_CODES.get(code, code), n)

    def stop(self) -> None:
        """Stop both threads after a last drain, and flush the sink."""
        if not self.running:
            self.poller.release()
            return
        # One deadline for the last drain (waiting for queue room) and the
        # sink's last writes; the sink gets at least a second of its own.
        self._stop_deadline = time.monotonic() + SINK_STOP_TIMEOUT
        self.poller.close()
        self._drain_t.join()
        if self.sink:                               # after everything drained: the last line
            self._enqueue(mark_line("stop"), 0)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self.sink:
            self._sink_t.join(max(self._stop_deadline - time.monotonic(), 1.0))
            if self._sink_t.is_alive():             # stuck in a write: do not wait for it
                with self._cv:
                    queued = sum(count for _, count in self._queue)
                    self._queue.clear()
                    self.queued_bytes = 0
                n = self.sink.abandon(queued)
                log.error("sink %s still blocked after %g s at stop (a reader that stopped reading?): "
                          "%d records counted lost", self.sink.name, SINK_STOP_TIMEOUT, n)
            self.sink.close()
        self._log_queue_losses()                    # what the rate limit held back
        self.poller.release()
        self.running = False
