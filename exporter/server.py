"""The HTTP endpoint: /metrics, /stats, /, /healthz, /readyz."""
from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional, Tuple

from prometheus_client.exposition import choose_encoder

from . import __version__, landing as landing_page

log = logging.getLogger(__name__)

_LISTEN = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%\w]*:[0-9A-Fa-f:.%\w]*)\]|(?P<host>[^\[\]:]*)):(?P<port>[0-9]{1,5})$", re.ASCII)


def parse_listen(addr: str) -> Tuple[str, int]:
    """':42424' -> ('', 42424); '127.0.0.1:9' -> ('127.0.0.1', 9); '[::1]:9' -> ('::1', 9)."""
    m = _LISTEN.match(addr)
    if not m or int(m["port"]) > 65535:
        raise ValueError(f"--web.listen-address: expected HOST:PORT or [IPV6]:PORT, got {addr!r}")
    return (m["v6"] if m["v6"] is not None else m["host"]), int(m["port"])


HANDSHAKE_TIMEOUT = 10.0     # seconds a client may take to finish the TLS handshake


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    web = None                  # a webconfig.Web: TLS and basic auth in force

    def finish_request(self, request, client_address) -> None:
        # In the connection's own thread: a slow handshake holds no one else.
        ctx = self.web.current.tls if self.web else None
        if ctx is None:
            return super().finish_request(request, client_address)
        timeout = request.gettimeout()
        request.settimeout(HANDSHAKE_TIMEOUT)
        try:
            conn = ctx.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as e:        # plain HTTP, a refused certificate, a timeout
            log.debug("TLS handshake with %s failed: %s", client_address[0], e)
            return
        try:
            conn.settimeout(timeout)
            super().finish_request(conn, client_address)
        finally:
            conn.close()


class _Server6(_Server):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # An empty host listens on every address, IPv4 included (dual stack).
        if self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve(addr: str, registry, stats: Callable[[], dict],
          readiness: Callable[[], Optional[str]], web=None,
          landing: Optional[Callable[[], dict]] = None, telemetry_path: str = "/metrics",
          start: bool = True) -> _Server:
    """Start serving in a background thread; readiness() returns None when
    ready, else the reason it is not. web: a webconfig.Web (TLS, basic
    auth, headers), read anew for each connection and request. landing():
    the document of the page at / (exporter/landing.py); without it the
    page has the version and the links. telemetry_path: where the
    metrics are (--web.telemetry-path). start=False: bound and listening,
    served once the caller runs srv.serve_forever."""
    landing = landing or (lambda: {"version": __version__})
    host, port = parse_listen(addr)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        extra = ()

        def _send(self, code: int, body: bytes, ctype: str, headers=()) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (*self.extra, *headers):
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if web is not None:
                # As the exporter toolkit: headers on every answer, and with
                # users configured, every path needs one (/healthz too).
                cfg = web.current
                self.extra = cfg.headers
                if not web.authorized(cfg, self.headers.get("Authorization")):
                    self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8",
                               (("WWW-Authenticate", "Basic"),))
                    return
            try:
                if path == telemetry_path:
                    encoder, ctype = choose_encoder(self.headers.get("Accept"))
                    self._send(200, encoder(registry), ctype)
                elif path == "/stats":
                    self._send(200, json.dumps(stats(), indent=2, sort_keys=True).encode() + b"\n",
                               "application/json")
                elif path == "/":
                    self._send(200, landing_page.render(landing()).encode(), "text/html; charset=utf-8")
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    why = readiness()
                    if why is None:
                        self._send(200, b"ready\n", "text/plain; charset=utf-8")
                    else:
                        self._send(503, f"not ready: {why}\n".encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except BrokenPipeError:
                pass
            except Exception as e:
                log.exception("serving %s failed", path)
                self._send(500, f"error: {e}\n".encode(), "text/plain; charset=utf-8")

        do_HEAD = do_GET

        def log_message(self, fmt, *args) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    if ":" in host:
        srv = _Server6((host, port), Handler)
    elif host == "" and socket.has_ipv6:
        try:
            srv = _Server6(("::", port), Handler)
        except OSError:                      # no IPv6 on this host
            srv = _Server(("", port), Handler)
    else:
        srv = _Server((host, port), Handler)
    srv.web = web
    if start:
        threading.Thread(target=srv.serve_forever, name="nettap-http", daemon=True).start()
    return srv
