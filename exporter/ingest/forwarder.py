"""What to send next, and what the engine acknowledged: the capture's files
cut into regions in order, one file at a time, with the checkpoint moved only
over acknowledged regions (docs/ingest.md).

No network here and no clock of its own (``now`` is given): the publisher
(exporter/ingest/publisher.py) sends the messages of the regions
:meth:`Forwarder.take` returns and reports each acknowledgement back.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

from exporter.ingest import batches, checkpoint
from exporter.ingest.batches import Message, Region
from exporter.ingest.checkpoint import Checkpoint, CheckpointError
from exporter.ingest.files import Files, Tracked, count_lines
from exporter.ingest.stats import Stats

log = logging.getLogger("nettap.ingest")

READ_BYTES = 1 << 20          # at most this much is read from a file at a time


class Forwarder:
    def __init__(self, files: Files, checkpoint_path: str, node: str, subject: str, stats: Stats,
                 batch_bytes: int = 64 << 10, max_in_flight: int = 2 << 20, max_message: int = 1 << 20,
                 clock: Callable[[], float] = None) -> None:
        import time
        self.files, self.path, self.node, self.subject = files, checkpoint_path, node, subject
        self.stats = stats
        # max_message: the largest message the engine takes, headers included (the server's
        # max_payload, a stream's max_msg_size): the publisher's limit, set before each take()
        self.batch_bytes, self.max_in_flight, self.max_message = batch_bytes, max_in_flight, max_message
        self.clock = clock or time.time
        self.cur: Optional[Tracked] = None
        self.cur_gone = False
        self.acked_to = 0                        # everything before this offset of cur is acknowledged
        self.cut_end = 0                         # regions are cut up to here
        self.regions: Deque[Region] = deque()    # cut, not all acknowledged, in order
        self.fresh: List[Region] = []            # cut, not handed to the publisher yet
        self.in_flight = 0                       # bytes of self.regions
        self.seen: Deque[Tuple[int, int, float]] = deque()   # (seq, size, when first seen that long)
        self.done_seq = 0                        # files up to this seq are forwarded
        self._moved = False                      # acknowledged offset moved since the last save
        self._unsaved = False                    # regions cut and not in the checkpoint yet: they wait
        self._failing = False                    # the last checkpoint write failed (logged once an episode)

    # -- start ---------------------------------------------------------------------------

    def start(self) -> None:
        """Where the checkpoint says; the regions it journalled are the
        first taken, cut exactly as before. A checkpoint that does not fit
        its file (an offset past its end or not at a line's start) is not
        believed: every file is forwarded from its start."""
        try:
            cp = checkpoint.load(self.path)
        except CheckpointError as e:
            log.warning("%s; starting over: forwarding every capture file from its start (the engine drops "
                        "what it has within its duplicate window)", e)
            cp = None
        self.files.scan()
        for t in self.files.order:               # what is on disk was written before now: its mtime says when
            try:
                self.seen.append((t.seq, t.size(), os.fstat(t.fd).st_mtime))
            except OSError:
                pass
        if cp is None or cp.file is None:
            self._switch(self._next())
            return
        t = self.files.find(cp.file)
        if t is None:
            log.error("capture file %s of the checkpoint is gone (rotated away while ingest was not running): "
                      "the records it had after offset %d are lost, how many is unknown", cp.file, cp.offset)
            self._switch(self._next())
            return
        self.cur = t
        lie = self._lie(cp)
        if lie:
            log.warning("checkpoint %s: %s of %s; starting over: forwarding every capture file from its start "
                        "(the engine drops what it has within its duplicate window)", self.path, lie, t.name)
            self.cur = None
            self._switch(self._next())
            return
        self.acked_to, self.cut_end = cp.offset, cp.offset
        for end in cp.cuts:
            self._add(batches.region(t.fid, self.cut_end, os.pread(t.fd, end - self.cut_end, self.cut_end),
                                     self.node, self.subject))
        log.info("resuming %s at offset %d with %d region(s) to send again", t.name, self.acked_to,
                 len(self.fresh))

    def _lie(self, cp: Checkpoint) -> Optional[str]:
        """What in cp does not fit cur (None: all of it does). Every offset
        is at a line's start: 0, after a newline, or the end of a finished
        file (a last line cut by a crash)."""
        size = self.cur.size()
        for at in (cp.offset,) + cp.cuts:
            if at > size:
                return f"offset {at} is past the end ({size} bytes)"
            if at and os.pread(self.cur.fd, 1, at - 1) != b"\n" and not (at == size and self._finished()):
                return f"offset {at} is not at a line's start"
        return None

    # -- the files -----------------------------------------------------------------------

    def tick(self) -> None:
        """Look at the files: count what was rotated away unforwarded, and
        note the newest file's growth (for the backlog's age)."""
        for t in self.files.scan():
            self._gone(t)
        if self.cur is None:
            self._switch(self._next())
        newest = self.files.newest()
        if newest is not None:
            size = newest.size()
            if not self.seen or (self.seen[-1][0], self.seen[-1][1]) < (newest.seq, size):
                now = self.clock()
                if self.seen and self.seen[-1][0] == newest.seq and now - self.seen[-1][2] < 1.0:
                    pass                         # one point a second is enough for an age
                else:
                    self.seen.append((newest.seq, size, now))
        self._backlog()

    def _gone(self, t: Tracked) -> None:
        if t is self.cur:
            lost = count_lines(t.fd, self.cut_end)
            self.cur_gone = True                 # its descriptor kept until the switch: a region may be re-read
        elif t.seq > (self.cur.seq if self.cur is not None else self.done_seq):
            lost = count_lines(t.fd, 0)
        else:
            lost = 0
        if t is not self.cur:
            self.files.release(t)
        if lost:
            self.stats.lost["rotated"] += lost
            log.error("capture file %s was rotated away before ingest forwarded it: %d record(s) lost "
                      "(nettap_ingest_records_lost_total{reason=\"rotated\"}); the engine was too slow or "
                      "unreachable for output.max_bytes x output.backups of capture", t.name, lost)
        self._advance()

    def _switch(self, t: Optional[Tracked]) -> None:
        """Forward t from its start. The file before it stays open (and
        older than t) until rotation removes it."""
        if self.cur is not None:
            self.done_seq = self.cur.seq
            if self.cur_gone:
                self.files.release(self.cur)
        self.cur, self.cur_gone = t, False
        self.acked_to = self.cut_end = 0
        if t is not None and not self._save():
            self._unsaved = True

    def _next(self) -> Optional[Tracked]:
        """The file after cur (after the last one forwarded while there is no cur)."""
        return self.files.after(self.cur.seq if self.cur is not None else self.done_seq)

    def _finished(self) -> bool:
        """Will cur get no more lines? (The capture writes only at path.)"""
        c = self.cur
        return self.cur_gone or (c.missing == 0 and not self.files.at_path(c) and c in self.files.order)

    def _backlog(self) -> None:
        behind = 0
        if self.cur is not None and not self.cur_gone:
            behind = max(self.cur.size() - self.acked_to, 0)
        elif self.cur is not None:
            behind = max(self.cut_end - self.acked_to, 0)
        for t in self.files.order:
            if self.cur is not None and t.seq > self.cur.seq:
                behind += t.size()
        self.stats.backlog_bytes = behind
        at = (self.cur.seq, self.acked_to) if self.cur is not None else (0, 0)
        while self.seen and (self.seen[0][0], self.seen[0][1]) <= at:
            self.seen.popleft()
        self.stats.backlog_seconds = max(self.clock() - self.seen[0][2], 0.0) if behind and self.seen else 0.0

    # -- cutting -------------------------------------------------------------------------

    def take(self) -> List[Region]:
        """Regions to send now: the journalled ones first, then new ones
        cut from what the files hold, within the bytes allowed in flight.
        The new ones are in the checkpoint before this returns: while it
        cannot be written, none is (a region sent and not journalled would
        be cut differently after a crash, and stored twice)."""
        cut = False
        while self.cur is not None and not self.cur_gone and self.in_flight < self.max_in_flight:
            n = self._cut_some()
            if n:
                cut = True
                continue
            if self.regions or not self._finished() or self.cut_end < self.cur.size():
                break
            nxt = self._next()
            if nxt is None:
                break
            self._switch(nxt)
        if (cut or self._unsaved) and not self._save():
            self._unsaved = True
            return []
        self._unsaved = False
        out, self.fresh = self.fresh, []
        return out

    def _cut_some(self) -> int:
        """Cut regions from cur's complete lines: bytes cut."""
        c, pos = self.cur, self.cut_end
        want = min(READ_BYTES, self.max_in_flight - self.in_flight)
        data = os.pread(c.fd, want, pos)
        end = data.rfind(b"\n") + 1
        if not end:
            if not data:
                return 0
            if len(data) < want:
                if not self._finished():
                    return 0                     # a line being written
                end = len(data)                  # a finished file's last line, cut by a crash
            else:
                return self._long_line(pos)
        view = memoryview(data)                 # regions are views of the one read: no copies
        most = self._most()
        at, batch = 0, min(self.batch_bytes, most)     # the engine may take less than a batch
        while at < end:
            stop = data.rfind(b"\n", at, min(at + batch, end)) + 1
            if stop <= at:                      # one line longer than a batch: alone
                stop = data.find(b"\n", at, end) + 1 or end
                if stop - at > most:
                    self._too_large(pos + at, pos + stop)
                    at = stop
                    continue
            self._add(batches.region(c.fid, pos + at, view[at:stop], self.node, self.subject))
            at = stop
        return end

    def _long_line(self, pos: int) -> int:
        """A line longer than one read: sent alone if a message can hold
        it, else skipped and counted lost."""
        c, at = self.cur, pos
        while True:
            piece = os.pread(c.fd, 1 << 20, at)
            if not piece:
                if not self._finished():
                    return 0                     # still being written
                end = at
                break
            nl = piece.find(b"\n")
            if nl >= 0:
                end = at + nl + 1
                break
            at += len(piece)
        if end - pos <= self._most():
            self._add(batches.region(c.fid, pos, os.pread(c.fd, end - pos, pos), self.node, self.subject))
        else:
            self._too_large(pos, end)
        return end - pos

    def _too_large(self, pos: int, end: int) -> None:
        self.stats.lost["too_large"] += 1
        log.error("%s: a line of %d bytes at offset %d is larger than a message may be (%d bytes): "
                  "1 record lost (nettap_ingest_records_lost_total{reason=\"too_large\"})",
                  self.cur.name, end - pos, pos, self._most())
        self._add(Region(self.cur.fid, pos, end))   # journalled like any region: never cut differently

    def _most(self) -> int:
        """The most bytes of lines a message of cur may hold."""
        return max(self.max_message - batches.header_room(self.node, self.cur.fid), 1)

    def split(self, m: Message, limit: int) -> List[Message]:
        """m is larger than the engine takes now (limit, headers included: a
        server's or a stream's limit lower than when its region was cut,
        before a restart or a reconnect): its lines as parts that fit, to be
        sent in its place; a line longer than any message is counted lost."""
        r, c = m.region, self.cur
        most = limit - batches.header_room(self.node, r.fid, m.kind)
        if c is not None and r.fid == c.fid and most > 0:
            a, b = m.span
            got, lost = batches.parts(m, os.pread(c.fd, b - a, a), self.node, most)
        else:                                    # not cur's (never: regions are cur's): not sendable
            got, lost = [], m.records
        if lost:
            self.stats.lost["too_large"] += lost
            log.error("%s: %d line(s) of region %d-%d are larger than a message may be (%d bytes): lost "
                      "(nettap_ingest_records_lost_total{reason=\"too_large\"})", r.fid, lost, r.start, r.end, limit)
        log.info("region %d-%d of %s: a message of %d bytes is more than the engine takes (%d bytes): sent as %d "
                 "part(s)", m.span[0], m.span[1], r.fid, len(m.payload), limit, len(got))
        r.messages = [x for x in r.messages if x is not m] + got
        r.pending += len(got)
        self._settle(m)
        return got

    def _add(self, r: Region) -> None:
        self.regions.append(r)
        self.fresh.append(r)
        self.cut_end = r.end
        self.in_flight += r.end - r.start
        if r.done:
            self._advance()

    # -- acknowledgements ----------------------------------------------------------------

    def acked(self, m: Message, duplicate: bool) -> None:
        s = self.stats
        if duplicate:
            s.acked_messages["duplicate"] += 1
        else:
            s.acked_messages["stored"] += 1
            s.records_acked += m.records
            s.bytes_acked += len(m.payload)
        self._settle(m)

    def rejected(self, m: Message, why: str) -> None:
        """The engine refused m for good (not retried): its records are lost."""
        self.stats.lost["rejected"] += m.records
        log.error("the engine refused a message of %d record(s) from %s (%s): lost "
                  "(nettap_ingest_records_lost_total{reason=\"rejected\"})", m.records, m.region.fid, why)
        self._settle(m)

    def _settle(self, m: Message) -> None:
        r = m.region
        m.payload = b""                          # acknowledged: never sent again; its bytes go now
        r.pending -= 1
        if r.pending == 0:
            self._advance()

    def _advance(self) -> None:
        moved = False
        while self.regions and self.regions[0].done:
            r = self.regions.popleft()
            r.messages = []                      # a region and its messages refer to each other: freed now,
            self.in_flight -= r.end - r.start    # not at the cycle collector's next pass
            if self.cur is not None and r.fid == self.cur.fid:
                self.acked_to = r.end
            moved = True
        self._moved |= moved
        if not self.regions and self.cur_gone:
            self._switch(self._next())

    def save_if_moved(self) -> None:
        """Persist the acknowledged offset (the run loop calls it now and then)."""
        if self._moved and self.cur is not None and not self.cur_gone:
            self._save()

    def _save(self) -> bool:
        """Write the checkpoint: False when it cannot be (counted; logged
        once until a write succeeds again)."""
        self._moved = False
        cp = Checkpoint(self.cur.fid if self.cur else None, self.acked_to, tuple(r.end for r in self.regions))
        try:
            checkpoint.save(self.path, cp)
        except OSError as e:
            self._moved = True
            self.stats.checkpoint_errors += 1
            if not self._failing:
                log.error("checkpoint %s: cannot write: %s; nothing more is sent until it can be "
                          "(nettap_ingest_checkpoint_write_errors_total)", self.path, e.strerror)
            self._failing = True
            return False
        if self._failing:
            log.warning("checkpoint %s: written again; forwarding resumes", self.path)
            self._failing = False
        return True

    def close(self) -> None:
        if self.cur is not None and not self.cur_gone:
            self._save()
        if self.cur is not None and self.cur_gone:
            self.files.release(self.cur)
        self.files.close()
