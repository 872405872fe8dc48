"""The HTTP endpoint: /metrics, /stats, /, /healthz and /readyz (also as
Prometheus' own /-/healthy and /-/ready)."""
from __future__ import annotations

import json
import logging
import socket
import threading
import weakref
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from exporter import __version__
from exporter.web import landing as landing_page
from exporter.web.exposition import TextRenderer
from exporter.web.listen import bind_all, parse_listen  # noqa: F401 (parse_listen: this module's before)
from exporter.web.transport import Handler, HttpCollector, Limits, Server

log = logging.getLogger(__name__)

# One collector per registry, summing its servers (tests serve one registry many times).
_COLLECTORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# One text renderer per registry (it keeps the registry's label texts between scrapes).
_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# zlib's fastest level: the golden /metrics (23 KB) in 0.55 ms to 5.4 KB, where level 6 takes
# 0.77 ms for 4.8 KB; a scrape's bytes matter less than the node's CPU.
GZIP_LEVEL = 1


def gzip_accepted(header: Optional[str]) -> bool:
    """Does an Accept-Encoding header take gzip (RFC 9110 12.5.3: a coding
    with q=0 is refused; a bare * is not taken for gzip, as Go's promhttp)?"""
    for part in (header or "").split(","):
        coding, *params = [p.strip() for p in part.split(";")]
        if coding.lower() not in ("gzip", "x-gzip"):
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False

@dataclass(frozen=True)
class _Site:
    """What is served: the callables serve() was given."""
    registry: object
    stats: Callable[[], dict]
    readiness: Callable[[], Optional[str]]
    web: object
    landing: Callable[[], dict]
    telemetry_path: str
    renderer: TextRenderer


class _Routes(Handler):
    """nettap's paths, answered from the server's site."""
    extra = ()
    coding = "identity"         # the answer's Content-Encoding, for the log line

    def _send(self, code: int, body: bytes, ctype: str, headers=(), compress: bool = False) -> None:
        """compress: gzip body if the client takes it (the metrics, as Go's promhttp)."""
        if compress:
            headers = (*headers, ("Vary", "Accept-Encoding"))
            if gzip_accepted(self.headers.get("Accept-Encoding")):
                # wbits 31: the gzip container (zlib.compress releases the GIL while it works)
                body, self.coding = zlib.compress(body, GZIP_LEVEL, wbits=31), "gzip"
                headers = (*headers, ("Content-Encoding", "gzip"))
        self.size = len(body)
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (*self.extra, *headers):
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _refused(self, web) -> bool:
        """As the exporter toolkit: headers on every answer, and with users
        configured, every path needs one (/healthz too). True when the
        request was refused (and answered)."""
        cfg = web.current
        self.extra = cfg.headers
        verdict = web.check(cfg, self.headers.get("Authorization"), self.client_address[0])
        if verdict == web.OK:
            return False
        # The connection ends with the answer: requests pipelined behind a
        # refused one get no check of their own.
        self.close_connection = True
        if verdict == web.THROTTLED:
            self.server.rejected["auth_throttled"] += 1
            self._send(429, b"Too Many Requests: failed password checks used their share of CPU\n",
                       "text/plain; charset=utf-8", (("Retry-After", "1"), ("Connection", "close")))
        else:
            self.server.rejected["unauthorized"] += 1
            self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                       (("WWW-Authenticate", "Basic"), ("Connection", "close")))
        return True

    def do_GET(self) -> None:
        site: _Site = self.server.site
        path = self.path.split("?", 1)[0]
        if site.web is not None and self._refused(site.web):
            return
        text = "text/plain; charset=utf-8"
        try:
            if path == site.telemetry_path:
                encoder, ctype = site.renderer.encoder(self.headers.get("Accept"))
                self._send(200, encoder(site.registry), ctype, compress=True)
            elif path == "/stats":
                self._send(200, json.dumps(site.stats(), indent=2, sort_keys=True).encode() + b"\n",
                           "application/json")
            elif path == "/":
                self._send(200, landing_page.render(site.landing()).encode(), "text/html; charset=utf-8")
            elif path in ("/healthz", "/-/healthy"):
                self._send(200, b"ok\n", text)
            elif path in ("/readyz", "/-/ready"):
                why = site.readiness()
                if why is None:
                    self._send(200, b"ready\n", text)
                else:
                    self._send(503, f"not ready: {why}\n".encode(), text)
            else:
                self._send(404, b"not found\n", text)
        except BrokenPipeError:
            pass
        except Exception as e:
            log.exception("serving %s failed", path)
            self._send(500, f"error: {e}\n".encode(), text)

    do_HEAD = do_GET

    def log_request(self, code="-", size="-") -> None:
        # the request, the status, the bytes sent and how they were encoded
        self.log_message('"%s" %s %s %s', self.requestline, code, getattr(self, "size", size), self.coding)

    def log_message(self, fmt, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


def serve(addr: Union[str, Sequence[str]], registry, stats: Callable[[], dict],
          readiness: Callable[[], Optional[str]], web=None,
          landing: Optional[Callable[[], dict]] = None, telemetry_path: str = "/metrics",
          start: bool = True, limits: Optional[Limits] = None,
          sock: Union[socket.socket, Sequence[socket.socket], None] = None) -> Server:
    """Start serving in a background thread; readiness() returns None when
    ready, else the reason it is not. addr: one --web.listen-address or
    several, all served by the one server. web: a webconfig.Web (TLS, basic
    auth, headers), read anew for each connection and request. landing():
    the document of the page at / (exporter/web/landing.py); without it the
    page has the version and the links. telemetry_path: where the
    metrics are (--web.telemetry-path). start=False: bound and listening,
    served once the caller runs srv.serve_forever. sock: the socket(s)
    listen.bind made for addr already (the daemon binds before it imports
    this module)."""
    limits = limits or Limits()
    if sock is None:
        socks = bind_all([addr] if isinstance(addr, str) else addr, limits.backlog)
    else:
        socks = [sock] if isinstance(sock, socket.socket) else list(sock)
    srv = Server(socks, _Routes, limits)
    srv.web = web
    renderer = _RENDERERS.get(registry)
    if renderer is None:
        renderer = _RENDERERS[registry] = TextRenderer()
    srv.site = _Site(registry, stats, readiness, web, landing or (lambda: {"version": __version__}),
                     telemetry_path, renderer)
    coll = _COLLECTORS.get(registry)
    if coll is None:
        coll = _COLLECTORS[registry] = HttpCollector()
        registry.register(coll)
    coll.servers.add(srv)
    if start:
        threading.Thread(target=srv.serve_forever, name="nettap-http", daemon=True).start()
    return srv
