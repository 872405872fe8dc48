"""Messages to the engine and their acknowledgements: one connection
(nats-py, the engine's own asyncio client), one reply subscription for every
acknowledgement, and for each message in flight a deadline.

JetStream acknowledges a publish by replying to it. A reply may never come
(a connection lost, a leader lost with its quorum): past its deadline a
message is sent again under the same id, since a timed-out publish may still
be stored, and the engine drops the second copy. 503 (no stream answered:
an election, ~5 s) is retried after a pause; a refusal (message too large,
wrong stream) is final and its records are counted lost.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Callable, Dict, List, Optional

from exporter.ingest.batches import Message, header_bytes, header_room
from exporter.ingest.files import FileId
from exporter.ingest.stats import Stats

log = logging.getLogger("nettap.ingest")

MSG_TOO_LARGE = 10054        # JetStream's err_code: a message above the stream's max_msg_size
RETRY_PAUSE = 0.5            # seconds before a 503'd message is sent again
LOG_EVERY = 10.0             # at most one line per kind of trouble this often
CONNECT_BACKOFF = (0.5, 5.0)  # seconds between failed first connections: doubling from, up to


def classify(e: BaseException) -> str:
    """A failed connection attempt's reason label."""
    text = str(e)
    if "Authorization Violation" in text or "authorization" in text.lower() or "Authentication" in text:
        return "auth"
    if isinstance(e, ssl.SSLError) or "SSL" in text or "certificate" in text:
        return "tls"
    if isinstance(e, (ConnectionRefusedError, ConnectionResetError)) or "refused" in text.lower():
        return "refused"
    return "other"


class Publisher:
    """on_ack(message, duplicate), on_reject(message, why) and
    on_too_large(message, limit) -> [parts] are the forwarder's."""

    def __init__(self, settings, stats: Stats, on_ack: Callable, on_reject: Callable, on_too_large: Callable,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s, self.stats, self.on_ack, self.on_reject, self.clock = settings, stats, on_ack, on_reject, clock
        self.on_too_large = on_too_large
        self.nc = None
        self.ready = False                      # connected, stream checked, reply subscription in place
        self.prefix = ""
        self.pending: Dict[str, Message] = {}   # reply token -> message awaiting its ack
        self.later: List[tuple] = []            # (when, message): sent again then
        self.wake = asyncio.Event()
        self._next = 0
        self._logged: Dict[str, float] = {}
        self.max_payload = 1 << 20
        self.stream_max = 0                     # the stream's max_msg_size (0: none), lowered by a refusal
        self._relook = False                    # a refusal for size: read the stream's max_msg_size again
        self.last_error = ""                    # the reason label of the last failed connection attempt
        self._counted: Optional[BaseException] = None

    def _log(self, key: str, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY) >= LOG_EVERY:
            self._logged[key] = now
            log.log(level, msg, *args)

    # -- the connection ------------------------------------------------------------------

    async def _error(self, e: Exception) -> None:
        reason = classify(e)
        self._counted = e
        if self.nc is None or not self.nc.is_connected:
            self.stats.connect_errors[reason] += 1
            self.last_error = reason
        hint = {"auth": " (check ingest's credentials)", "tls": " (check ingest.tls)"}.get(reason, "")
        self._log("connect-" + reason, logging.ERROR, "engine %s: %s%s; retrying", ",".join(self.s.servers),
                  e or type(e).__name__, hint)

    async def _disconnected(self) -> None:
        self.ready = False
        self.stats.connected = 0
        self._log("disconnected", logging.WARNING, "disconnected from the engine; reconnecting")

    async def _reconnected(self) -> None:
        self.stats.connected = 1
        log.info("reconnected to the engine at %s", self.nc.connected_url.netloc if self.nc.connected_url else "?")
        self._resend_all("disconnected")
        self.ready = True
        self.wake.set()

    async def connect(self) -> None:
        """Connect (retrying for ever: errors counted and logged), check the
        stream, subscribe to the replies."""
        wait = CONNECT_BACKOFF[0]
        while True:
            try:
                self.nc = await self._connect_once()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:              # counted once: by nats-py's error_cb, or here
                if e is not self._counted:
                    await self._error(e)
                await asyncio.sleep(wait)
                wait = min(wait * 2, CONNECT_BACKOFF[1])
        self.stats.connected = 1
        self.last_error = ""
        self.prefix = self.nc.new_inbox() + "."
        await self.nc.subscribe(self.prefix + "*", cb=self._reply)
        while True:
            try:
                info = await ensure_stream(self.nc, self.s)
                self.stream_max = max(getattr(info.config, "max_msg_size", None) or 0, 0)
                most, why = fit(self.s, self.nc.max_payload, self.stream_max)
                if most < self.s.batch_bytes:
                    log.warning("%s: messages are cut to fit", why)
                break
            except StreamError as e:            # the stream's config: an admin's to fix
                self._log("stream", logging.ERROR, "%s; retrying", e)
                await asyncio.sleep(5.0)
            except Exception as e:              # a stream without a leader yet, a timeout
                self._log("stream", logging.WARNING, "stream %s not ready: %s; retrying", self.s.stream.name, e)
                await asyncio.sleep(1.0)
        log.info("connected to the engine at %s; stream %s", self.nc.connected_url.netloc, self.s.stream.name)
        self.ready = True
        self.wake.set()

    async def _connect_once(self):
        """One connection, attempted on each server in turn until one takes
        it (nats-py waits between rounds): a refused TCP connection is retried
        in there, anything else (a TLS handshake, credentials) raises here.
        nats-py's own retry of those never comes back from closing the
        failed TLS stream (its wait_closed() never ends) and never tries
        again; once connected its reconnects are fine, so they are switched
        on then."""
        from nats.aio.client import Client
        nc = Client()
        await nc.connect(
            servers=list(self.s.servers), name=f"nettap-ingest {self.s.node}", allow_reconnect=False,
            max_reconnect_attempts=-1, reconnect_time_wait=1, connect_timeout=self.s.connect_timeout,
            error_cb=self._error, disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
            pending_size=self.s.max_in_flight_bytes * 2 + (1 << 20), flush_timeout=self.s.ack_timeout,
            **self.s.auth_options())
        nc.options["allow_reconnect"] = True     # read at each disconnection
        return nc

    @property
    def limit(self) -> int:
        """The largest message, headers included, the engine takes now: the
        server's max_payload (the one connected to), the stream's max_msg_size."""
        most = self.nc.max_payload if self.nc is not None and self.nc.max_payload else self.max_payload
        return min(most, self.stream_max) if self.stream_max else most

    # -- sending -------------------------------------------------------------------------

    async def send(self, m: Message) -> None:
        if len(m.payload) + header_bytes(m.headers) > self.limit:
            for part in self.on_too_large(m, self.limit):
                if len(part.payload) + header_bytes(part.headers) <= self.limit:
                    await self.send(part)
                else:                           # never (parts fit by their making): not again and again
                    self.on_reject(part, "larger than the engine takes, in parts too")
            return
        self._next += 1
        m.token = format(self._next, "x")
        m.deadline = self.clock() + self.s.ack_timeout
        self.pending[m.token] = m
        self.stats.records_published += m.records
        self.stats.bytes_published += len(m.payload)
        try:
            # Bounded: a publish waits for the client's flusher when its buffer is full, and a
            # connection that died unnoticed would hold the whole loop there.
            await asyncio.wait_for(self.nc.publish(m.subject, m.payload, reply=self.prefix + m.token,
                                                   headers=m.headers), self.s.ack_timeout)
        except Exception as e:                  # the buffer full while reconnecting, a closed connection
            self.pending.pop(m.token, None)
            self.stats.publish_errors["disconnected"] += 1
            self.later.append((self.clock() + RETRY_PAUSE, m))
            self._log("publish", logging.WARNING, "publish failed, sent again later: %s", e)

    async def _reply(self, msg) -> None:
        m = self.pending.pop(msg.subject[len(self.prefix):], None)
        if m is None:
            return                              # the ack of a copy already timed out and sent again
        try:
            status = msg.headers.get("Status") if msg.headers else None
            if status == "503":
                self.stats.publish_errors["no_responders"] += 1
                self._log("503", logging.WARNING, "no stream answered on %s (an election, or no stream takes "
                          "the subject); sending again", m.subject)
                self.later.append((self.clock() + RETRY_PAUSE, m))
                return
            doc = json.loads(msg.data) if msg.data else {}
            err = doc.get("error")
            if err:
                code = err.get("code", 0)
                if code >= 500 or code in (408, 429):     # for now (no leader, no room): again, later
                    self.stats.publish_errors["timeout" if code == 408 else "no_responders"] += 1
                    self._log("busy", logging.WARNING, "the engine cannot store a message now (%s %s %s); "
                              "sending again", code, err.get("err_code", ""), err.get("description", ""))
                    self.later.append((self.clock() + RETRY_PAUSE, m))
                    return
                if err.get("err_code") == MSG_TOO_LARGE:       # the stream's limit went down: cut to fit
                    size = len(m.payload) + header_bytes(m.headers)
                    self.stream_max = min(self.stream_max or size, size - 1)
                    self._relook = True
                    self._log("too-large", logging.WARNING, "stream %s refused a message of %d bytes (%s): "
                              "cutting messages to fit its max_msg_size", self.s.stream.name, size,
                              err.get("description"))
                    self.later.append((self.clock(), m))
                    return
                self.stats.publish_errors["rejected"] += 1
                self.on_reject(m, f"{code} {err.get('err_code', '')} {err.get('description', '')}".strip())
            else:
                self.on_ack(m, bool(doc.get("duplicate")))
        except Exception as e:                  # a reply that is not JSON: send again
            self._log("reply", logging.WARNING, "unreadable acknowledgement (%s); sending again", e)
            self.later.append((self.clock() + RETRY_PAUSE, m))
        finally:
            self.wake.set()

    def _resend_all(self, reason: str) -> None:
        """After a reconnect: every ack in flight was lost with the old connection."""
        now = self.clock()
        for m in self.pending.values():
            self.stats.publish_errors[reason] += 1
            self.later.append((now, m))
        self.pending.clear()

    async def sweep(self) -> None:
        """Send again what timed out or waits for its pause."""
        if not self.ready:
            return
        if self._relook:
            await self._relook_stream()
        now = self.clock()
        for token, m in list(self.pending.items()):
            if m.deadline <= now:
                del self.pending[token]
                self.stats.publish_errors["timeout"] += 1
                self.later.append((now, m))
        due = [m for when, m in self.later if when <= now]
        if due:
            self.later = [(w, m) for w, m in self.later if w > now]
            for m in due:
                await self.send(m)

    async def _relook_stream(self) -> None:
        """The stream's max_msg_size now (an admin lowered it): at most it,
        and below what it refused already."""
        self._relook = False
        try:
            info = await self.nc.jetstream(timeout=self.s.connect_timeout).stream_info(self.s.stream.name)
        except Exception as e:                  # keep the limit the refusal taught
            self._log("relook", logging.WARNING, "stream %s: cannot read its config again: %s", self.s.stream.name, e)
            return
        now = getattr(info.config, "max_msg_size", None) or 0
        if 0 < now < self.stream_max:
            self.stream_max = now
        log.info("stream %s takes messages of at most %d bytes: cutting them to fit", self.s.stream.name,
                 self.stream_max)

    @property
    def in_flight(self) -> int:
        return len(self.pending) + len(self.later)

    async def close(self) -> None:
        nc, self.nc, self.ready = self.nc, None, False
        if nc is not None and not nc.is_closed:
            try:
                await nc.close()
            except Exception:                   # closing a broken connection: nothing left to do
                pass


class StreamError(RuntimeError):
    """The stream cannot take ingest's messages until someone changes it."""


async def ensure_stream(nc, s) -> Optional[object]:
    """The stream exists (created with the config's options when
    stream.create) and takes ingest's subjects; raises StreamError when it
    cannot be used as it is."""
    from nats.js.api import StorageType, StreamConfig
    from nats.js.errors import NotFoundError
    from exporter.ingest.batches import subjects_pattern
    js = nc.jetstream(timeout=s.connect_timeout)
    want = subjects_pattern(s.subject)
    st = s.stream
    try:
        info = await js.stream_info(st.name)
    except NotFoundError:
        if not st.create:
            raise StreamError(f"stream {st.name} does not exist (ingest.stream.create is false)") from None
        cfg = StreamConfig(name=st.name, subjects=[want], num_replicas=st.replicas, max_age=st.max_age,
                           max_bytes=st.max_bytes, duplicate_window=st.duplicate_window,
                           storage=StorageType.FILE if st.storage == "file" else StorageType.MEMORY)
        info = await js.add_stream(cfg)
        log.info("created stream %s (subjects %s, %d replica(s), duplicate window %gs)", st.name, want,
                 st.replicas, st.duplicate_window)
        return info
    subjects = info.config.subjects or []
    if not any(_covers(p, want) for p in subjects):
        raise StreamError(f"stream {st.name} takes {', '.join(subjects) or 'no subjects'}, not ingest's {want}")
    return info


def fit(s, max_payload: int, stream_max: int):
    """What the engine's limits make of ingest's messages (for the log and
    --check-config): (the most bytes of lines a message holds, why)."""
    limits = [f"the server's max_payload is {max_payload}"]
    if stream_max:
        limits.append(f"stream {s.stream.name}'s max_msg_size is {stream_max}")
    most = min(max_payload, stream_max or max_payload) - header_room(s.node, FileId(1 << 64, 1 << 64, "f" * 16))
    return max(most, 0), (f"{' and '.join(limits)} bytes: a message holds at most {max(most, 0)} bytes of lines "
                          f"(ingest.batch_bytes: {s.batch_bytes}); a longer line is lost (too_large)")


def _covers(pattern: str, subject: str) -> bool:
    """Does a stream subject pattern take every subject matching subject?"""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return i < len(s)
        if i >= len(s) or (tok != "*" and tok != s[i]) or (tok == "*" and s[i] == ">"):
            return False
    return len(p) == len(s)
