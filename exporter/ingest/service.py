"""Ingest's loop: look at the files, hand new regions to the publisher,
send again what timed out, save the checkpoint; on stop, wait a little for
what is in flight, then save where ingest is.

One asyncio loop in one thread: the files are local and read in pieces
(at most READ_BYTES at a time), so the loop never waits on them for long.
"""
from __future__ import annotations

import asyncio
import logging
import time

from exporter.ingest.files import Files
from exporter.ingest.forwarder import Forwarder
from exporter.ingest.publisher import Publisher
from exporter.ingest.stats import Stats

log = logging.getLogger("nettap.ingest")

TICK = 0.05                  # seconds between looks at the files while nothing else wakes the loop
SAVE_EVERY = 1.0             # the acknowledged offset is saved this often
DRAIN_TIMEOUT = 5.0          # at stop, seconds to wait for acknowledgements in flight
RETRY_CONNECT = 10.0         # seconds between connections that failed otherwise than nats-py retries


class Service:
    def __init__(self, settings, output, stats: Stats = None) -> None:
        self.s = settings
        self.stats = stats or Stats()
        self.forwarder = Forwarder(Files(output.path, output.backups), settings.checkpoint, settings.node,
                                   settings.subject, self.stats, settings.batch_bytes,
                                   settings.max_in_flight_bytes)
        self.publisher = Publisher(settings, self.stats, self.forwarder.acked, self.forwarder.rejected,
                                   self.forwarder.split)
        self.stopping = None
        self.ready = False                       # started: the checkpoint read and the files looked at

    async def run(self, stopping: asyncio.Event) -> None:
        self.stopping = stopping
        fw, pub = self.forwarder, self.publisher
        fw.start()
        self.ready = True
        connecting = asyncio.ensure_future(self._connect())
        saved = looked = time.monotonic()
        fw.tick()
        try:
            while not stopping.is_set():
                if time.monotonic() - looked >= TICK:          # not at every ack
                    fw.tick()
                    looked = time.monotonic()
                if pub.ready:
                    fw.max_message = pub.limit                  # the server's, the stream's: headers included
                    for r in fw.take():
                        for m in r.messages:
                            await pub.send(m)
                    await pub.sweep()
                if time.monotonic() - saved >= SAVE_EVERY:
                    fw.save_if_moved()
                    saved = time.monotonic()
                pub.wake.clear()
                try:
                    await asyncio.wait_for(pub.wake.wait(), TICK)
                except asyncio.TimeoutError:
                    pass
            await self._drain()
        finally:
            connecting.cancel()
            fw.close()
            await pub.close()

    def state(self) -> dict:
        """/stats: the counters, and where ingest is."""
        fw, pub = self.forwarder, self.publisher
        cur = fw.cur
        return {"counters": vars(self.stats),
                "file": None if cur is None else {"name": cur.name, "id": str(cur.fid), "acknowledged": fw.acked_to,
                                                  "cut": fw.cut_end},
                "regions_in_flight": len(fw.regions), "bytes_in_flight": fw.in_flight,
                "messages_awaiting_ack": len(pub.pending), "messages_to_send_again": len(pub.later),
                "ready": pub.ready}

    async def _connect(self) -> None:
        """nats-py retries a connection for ever; what it raises instead (a
        key or certificate it cannot use) is logged and tried again."""
        while True:
            try:
                await self.publisher.connect()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.stats.connect_errors["other"] += 1
                log.error("cannot connect to the engine: %s; trying again in %g s", e or type(e).__name__,
                          RETRY_CONNECT)
                await self.publisher.close()
                await asyncio.sleep(RETRY_CONNECT)

    async def _drain(self) -> None:
        """At stop: a few seconds for the acks in flight, so a restart sends
        less again (what is still in flight then is in the checkpoint)."""
        pub, deadline = self.publisher, time.monotonic() + DRAIN_TIMEOUT
        while pub.ready and pub.in_flight and time.monotonic() < deadline:
            await pub.sweep()
            pub.wake.clear()
            try:
                await asyncio.wait_for(pub.wake.wait(), TICK)
            except asyncio.TimeoutError:
                pass
        if pub.in_flight:
            log.info("stopping with %d message(s) not acknowledged: sent again at the next start",
                     pub.in_flight)
