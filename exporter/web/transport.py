"""The endpoint's transport: a bounded HTTP/1.1 server for a handful of
scrapers. A parking thread reads each connection's request line and headers
(TLS handshake included) under deadlines, a small pool of workers answers
whole requests, and answers are flushed by the selector, so a slow or idle
client holds no worker; every connection turned away is counted by reason.
What is served at which path is exporter/web/server.py's."""
from __future__ import annotations

import io
import logging
import queue
import re
import resource
import select
import selectors
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from socketserver import TCPServer
from typing import Dict, Iterable, List, Optional, Union

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.util.wakeup import Wakeup
from exporter.web.listen import BACKLOG

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0     # seconds a client may take to finish the TLS handshake


@dataclass(frozen=True)
class Limits:
    """How the endpoint bounds its clients. Connections wait for a request
    in one selector (no thread each); only a request whose line and headers
    have all arrived goes to a worker, so idle, half-open and slow clients
    cost a file descriptor and a buffer, never a worker. (Per-connection
    socket timeouts in a fixed pool would not do: N idle connections would
    hold N workers for a timeout each, and 2,000 of them would hold a
    scrape for minutes.) A worker renders an answer into memory and sends
    what the socket takes at once; the rest goes out from the selector as
    the client reads, within write_timeout, so a client that does not read
    holds no worker either, and the queue in front of the workers moves;
    when it is long anyway, a 503 now is better for a scraper than
    an answer after its scrape_timeout. Past max_connections (or half the
    file descriptor limit) the connection waiting longest is closed rather
    than the new one: under a flood of idle connections a scraper's new
    connection still gets in."""
    workers: int = 8             # rendering holds the GIL: more threads than this only queue on it
    backlog: int = BACKLOG       # listen(2) backlog (the kernel caps it at net.core.somaxconn)
    max_connections: int = 4096  # waiting at once; past it the longest-waiting one is closed
    max_queued: int = 512        # complete requests waiting for a worker; past it: 503
    header_timeout: float = 10.0  # from the first byte (or the connection) to the end of the headers
    idle_timeout: float = 120.0  # keep-alive wait for the next request (Prometheus' 1m interval fits)
    write_timeout: float = 10.0  # for a client to read a whole answer; then closed, counted write_timeout
    max_unsent_bytes: int = 64 << 20   # answers waiting for their clients to read, all together
    max_requests: int = 1000     # per keep-alive connection (nginx's keepalive_requests)
    max_header_bytes: int = 65536


REASONS = ("header_timeout", "write_timeout", "overload", "http09", "too_large", "unauthorized", "auth_throttled",
           "client_gone")
_END = re.compile(rb"\r?\n\r?\n")
_HTTP09 = re.compile(rb"^[A-Z]+ +[^ \r\n]+\r?\n")       # a request line without a version


class HttpCollector(Collector):
    """nettap_http_connections_rejected_total{reason}: connections the
    endpoint closed without an answer, or answered 503, to stay bounded."""

    def __init__(self, servers=()):
        self.servers = weakref.WeakSet(servers)     # each with .rejected: {reason: count}

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily("nettap_http_connections_rejected", "", labels=["reason"])]

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("nettap_http_connections_rejected",
                                "Connections the HTTP endpoint closed or answered 503 to stay bounded.",
                                labels=["reason"])
        for reason in REASONS:
            c.add_metric([reason], sum(srv.rejected.get(reason, 0) for srv in list(self.servers)))
        return [c]


class _Conn:
    __slots__ = ("sock", "addr", "buf", "deadline", "handshaking", "served", "events", "out", "keep")

    def __init__(self, sock, addr, deadline: float, handshaking: bool):
        self.sock, self.addr, self.buf = sock, addr, bytearray()
        self.deadline, self.handshaking, self.served, self.events = deadline, handshaking, 0, 0
        self.out: Optional[memoryview] = None   # an answer's unsent rest: the selector sends it
        self.keep = False                       # after it: the next request (else close)


_LISTENER = object()            # the parking selector's mark of a listening socket


class Server(TCPServer):
    allow_reuse_address = True
    web = None                  # a webconfig.Web: TLS and basic auth in force

    def __init__(self, socks: Union[socket.socket, List[socket.socket]], handler, limits: Limits = Limits()):
        """socks: bound and listening (exporter.web.listen.bind), one or
        several (--web.listen-address given more than once). The first is
        socketserver's, accepted by serve_forever's loop; the others are
        accepted by the parking thread, in its selector, into the same
        parking, workers and limits."""
        socks = [socks] if isinstance(socks, socket.socket) else list(socks)
        sock, self.more_sockets = socks[0], socks[1:]
        self.limits = limits
        self.rejected = {r: 0 for r in REASONS}
        # accept() failing with EMFILE would spin the accept loop: stay well under the limit.
        self._max_conns = min(limits.max_connections,
                              max(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2))
        self._sel = selectors.DefaultSelector()
        self._conns: Dict[int, _Conn] = {}          # by fd, oldest parked first
        self._incoming: "queue.SimpleQueue" = queue.SimpleQueue()   # parked from other threads
        self._unsent = 0                            # bytes of answers the selector still sends
        self._unsent_lock = threading.Lock()
        self._ready: "queue.Queue" = queue.Queue()
        self._closing = False
        self._sweep_at = 0.0                        # the next parked connection's deadline
        self._wakeup = Wakeup()
        self._sel.register(self._wakeup, selectors.EVENT_READ, None)
        for more in self.more_sockets:
            more.setblocking(False)
            self._sel.register(more, selectors.EVENT_READ, _LISTENER)
        self._threads: list = []
        super().__init__(sock.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()                         # the one TCPServer made, never bound
        self.socket = sock
        self.server_address = sock.getsockname()
        self._threads = [threading.Thread(target=self._park_loop, name="nettap-http-park", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"nettap-http-{i}", daemon=True)
                          for i in range(limits.workers)]

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        # The parking and worker threads start here, not when the socket is
        # bound: the daemon binds before loading and drops its capabilities
        # after, and capabilities belong to each thread (kernel/capability.c:
        # capset changes the caller's only). A thread started before the drop
        # would keep them all, and these parse what clients send.
        for t in self._threads:
            if t.ident is None:
                t.start()
        super().serve_forever(poll_interval)

    # -- the accept loop (serve_forever's thread) hands every connection over
    def process_request(self, request, client_address) -> None:
        request.setblocking(False)
        ctx = self.web.current.tls if self.web else None
        now = time.monotonic()
        if ctx is not None:
            try:
                request = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError) as e:
                log.debug("TLS with %s failed: %s", client_address[0], e)
                request.close()
                return
            self._park(_Conn(request, client_address, now + HANDSHAKE_TIMEOUT, True))
        else:
            self._park(_Conn(request, client_address, now + self.limits.header_timeout, False))

    def _park(self, c: _Conn) -> None:
        self._incoming.put(c)
        self._wakeup.wake()

    # -- the parking thread: connections waiting for a whole request
    def _park_loop(self) -> None:
        while not self._closing:
            for key, _ in self._sel.select(max(0.0, min(1.0, self._sweep_at - time.monotonic()))):
                if key.data is None:
                    self._wakeup.drain()
                elif key.data is _LISTENER:
                    self._accept(key.fileobj)
                elif key.data.out is not None:
                    self._flush(key.data)
                else:
                    self._progress(key.data)
            while True:
                try:
                    c = self._incoming.get_nowait()
                except queue.Empty:
                    break
                self._admit(c)
            now = time.monotonic()
            if now < self._sweep_at:
                continue
            # The sweep walks every parked connection: only when a deadline is due.
            self._sweep_at = now + 1.0
            for c in list(self._conns.values()):
                if c.deadline > now:
                    self._sweep_at = min(self._sweep_at, c.deadline)
                elif c.out is not None:              # a client that does not read its answer
                    self._reject(c, "write_timeout")
                elif c.buf or c.handshaking or c.served == 0:
                    self._reject(c, "header_timeout")
                else:
                    self._drop(c)                    # an idle keep-alive connection: normal
        for c in list(self._conns.values()):
            self._drop(c)

    def _accept(self, listener: socket.socket) -> None:
        """Connections on one of more_sockets, handed over as serve_forever's (64 at most: parked ones wait)."""
        for _ in range(64):
            try:
                request, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:                 # EMFILE, ENOBUFS: the next select tries again
                log.debug("accept on %s failed: %s", listener.getsockname(), e)
                return
            self.process_request(request, addr)

    @property
    def addresses(self) -> list:                 # every address served, as getsockname() has it
        return [self.server_address, *(s.getsockname() for s in self.more_sockets)]

    def _admit(self, c: _Conn) -> None:
        if len(self._conns) >= self._max_conns:
            self._reject(next(iter(self._conns.values())), "overload")
        self._conns[c.sock.fileno()] = c
        self._sweep_at = min(self._sweep_at, c.deadline)
        if c.out is not None:                   # an answer to send first
            return self._watch(c, selectors.EVENT_WRITE)
        self._watch(c, selectors.EVENT_READ)
        # Bytes already read (a pipelined request) or held inside TLS need no wait.
        if c.buf or (c.served and isinstance(c.sock, ssl.SSLSocket) and c.sock.pending()):
            self._progress(c)

    def _watch(self, c: _Conn, events: int) -> None:
        if c.events == events:
            return
        if c.events:
            self._sel.modify(c.sock, events, c)
        else:
            self._sel.register(c.sock, events, c)
        c.events = events

    def _forget(self, c: _Conn) -> None:
        if c.events:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.events = 0
        self._conns.pop(c.sock.fileno(), None)

    def _drop(self, c: _Conn) -> None:
        self._forget(c)
        if c.out is not None:                   # an answer it never read
            with self._unsent_lock:
                self._unsent -= len(c.out)
            c.out = None
        try:
            c.sock.close()
        except OSError:
            pass

    def _reject(self, c: _Conn, reason: str, answer: bytes = b"") -> None:
        self.rejected[reason] += 1
        if answer:
            try:
                c.sock.send(answer)         # best effort: never wait on this client
            except (OSError, ssl.SSLError):
                pass
        self._drop(c)

    def _progress(self, c: _Conn) -> None:
        try:
            if c.handshaking:
                try:
                    c.sock.do_handshake()
                except ssl.SSLWantReadError:
                    return self._watch(c, selectors.EVENT_READ)
                except ssl.SSLWantWriteError:
                    return self._watch(c, selectors.EVENT_WRITE)
                c.handshaking = False
                c.deadline = time.monotonic() + self.limits.header_timeout
                self._watch(c, selectors.EVENT_READ)
            while not _END.search(c.buf):
                try:
                    data = c.sock.recv(65536)
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return
                if not data:
                    return self._drop(c)
                if not c.buf and c.served:           # a keep-alive's next request begins
                    c.deadline = time.monotonic() + self.limits.header_timeout
                    self._sweep_at = min(self._sweep_at, c.deadline)
                c.buf += data
                if _HTTP09.match(c.buf):
                    return self._reject(c, "http09")
                if len(c.buf) > self.limits.max_header_bytes:
                    return self._reject(c, "too_large", b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                        b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        except (OSError, ssl.SSLError) as e:         # reset, plain HTTP on TLS, a refused certificate
            log.debug("connection from %s failed: %s", c.addr[0], e)
            return self._drop(c)
        self._forget(c)
        if self._ready.qsize() >= self.limits.max_queued:
            return self._reject(c, "overload", b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\n\r\n")
        self._ready.put(c)

    # -- the workers: one whole request each, then the connection goes back
    def _work(self) -> None:
        while True:
            c = self._ready.get()
            if c is None:
                return
            if _gone(c.sock):                    # nobody to answer: not rendered
                self.rejected["client_gone"] += 1
                c.sock.close()
                continue
            end = _END.search(c.buf).end()
            head, c.buf = bytes(c.buf[:end]), c.buf[end:]
            c.served += 1
            try:
                h = self.RequestHandlerClass(c, c.addr, self, head)
                c.keep = not h.close_connection and not self._closing
                answer = h.wfile.getvalue()
            except Exception as e:               # never lose a worker to one request
                log.debug("answering %s failed: %s", c.addr[0], e)
                c.sock.close()
                continue
            c.out = memoryview(answer)
            if self._send_some(c) == "failed":
                c.sock.close()
                continue
            if c.out is not None:                # the client has not taken it all: the selector sends the rest
                with self._unsent_lock:
                    full = self._unsent + len(c.out) > self.limits.max_unsent_bytes
                    if not full:
                        self._unsent += len(c.out)
                if full:
                    self.rejected["overload"] += 1
                    c.sock.close()
                    continue
                c.deadline = time.monotonic() + self.limits.write_timeout
                self._park(c)
            elif c.keep:
                c.deadline = time.monotonic() + (self.limits.header_timeout if c.buf else self.limits.idle_timeout)
                self._park(c)
            else:
                c.sock.close()

    def _send_some(self, c: _Conn) -> str:
        """Send what c's socket takes now of c.out (None once all is sent).
        Returns "done", "write" or "read" (what to wait for: TLS may need to
        read first), or "failed"."""
        try:
            while c.out is not None:
                n = c.sock.send(c.out)
                c.out = c.out[n:] if n < len(c.out) else None
        except (BlockingIOError, ssl.SSLWantWriteError):
            return "write"
        except ssl.SSLWantReadError:
            return "read"
        except (OSError, ssl.SSLError) as e:     # reset, gone
            log.debug("answering %s failed: %s", c.addr[0], e)
            return "failed"
        return "done"

    def _flush(self, c: _Conn) -> None:
        """The parking thread's part of an answer: send more; once all is
        out, the connection waits for its next request (or ends)."""
        before = len(c.out)
        wait = self._send_some(c)
        if wait == "failed":
            return self._drop(c)
        with self._unsent_lock:
            self._unsent -= before - (len(c.out) if c.out is not None else 0)
        if wait != "done":
            return self._watch(c, selectors.EVENT_READ if wait == "read" else selectors.EVENT_WRITE)
        if not c.keep:
            return self._drop(c)
        c.deadline = time.monotonic() + (self.limits.header_timeout if c.buf else self.limits.idle_timeout)
        self._sweep_at = min(self._sweep_at, c.deadline)
        self._watch(c, selectors.EVENT_READ)
        if c.buf or (isinstance(c.sock, ssl.SSLSocket) and c.sock.pending()):
            self._progress(c)

    def server_close(self) -> None:
        super().server_close()
        self._closing = True
        self._wakeup.wake()
        for _ in range(self.limits.workers):
            self._ready.put(None)
        for t in self._threads:
            if t.ident is not None:
                t.join(5)
        self._sel.close()
        self._wakeup.close()
        for more in self.more_sockets:
            more.close()


def _gone(sock) -> bool:
    """Has the client closed (or reset) its side? A request whose client
    has gone is not rendered: 1,100 abandoned /metrics requests a second
    (connect, send, close) otherwise each cost a render and held the
    workers (a scraper beside them: p50 2.7 s, a third 503). As nginx (its
    499) and Go's net/http, an end of the client's stream counts as gone,
    a half-close (shutdown(SHUT_WR)) after the request included: a TCP
    peer that closed and one that only stopped sending look the same until
    something is sent. The kernel's view, so TLS sockets too (a
    close_notify in flight does not hide the FIN)."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLRDHUP)
    try:
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                   for _, ev in p.poll(0))
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    """One request whose line and headers the parking thread has read."""
    protocol_version = "HTTP/1.1"

    def __init__(self, conn: _Conn, client_address, server: Server, head: bytes):
        self.conn, self.head = conn, head
        super().__init__(conn.sock, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BytesIO(self.head)
        self.wfile = io.BytesIO()              # sent by the worker, the rest by the selector

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def finish(self) -> None:
        pass

    def end_headers(self) -> None:
        if self.conn.served >= self.server.limits.max_requests and not self.close_connection:
            self.send_header("Connection", "close")
        super().end_headers()


