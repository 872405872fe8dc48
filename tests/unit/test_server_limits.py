"""exporter.web.server under load and abuse, with real sockets on loopback:
idle, half-sent and HTTP/0.9 connections hold no worker and are closed on
their timeouts; many scrapers at once are all answered; keep-alive is
limited; a full queue is answered 503 and counted."""
from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import threading
import time

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter

from exporter.web.server import Limits, serve


class App:
    def __init__(self):
        self.registry = CollectorRegistry()
        Counter("nettap_test_events", "Events seen by the test.", registry=self.registry).inc(3)
        self.gate = threading.Event()
        self.gate.set()
        self.rendered = 0

    def stats(self):
        self.gate.wait(30)           # a test closes the gate to keep a worker busy
        self.rendered += 1
        return {"ok": 1}

    def not_ready(self):
        return None


@pytest.fixture
def start():
    servers = []

    def start(**limits):
        app = App()
        srv = serve("127.0.0.1:0", app.registry, app.stats, app.not_ready, limits=Limits(**limits))
        servers.append((srv, app))
        return srv, app
    yield start
    for srv, app in servers:
        app.gate.set()
        srv.shutdown()
        srv.server_close()


def connect(srv) -> socket.socket:
    return socket.create_connection(srv.server_address, timeout=10)


@contextlib.contextmanager
def connections(srv, n: int):
    """n connections to srv, a list (what is appended to it is closed too), closed after."""
    conns = [connect(srv) for _ in range(n)]
    try:
        yield conns
    finally:
        for s in conns:
            s.close()


def request(path: str = "/healthz") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


def response(s: socket.socket) -> bytes:
    """The next whole answer (headers and Content-Length body) read off s."""
    f = _files.setdefault(s, s.makefile("rb"))
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = f.readline()
        assert line, f"closed mid-answer: {head!r}"
        head += line
    n = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")))
    return head + f.read(n)


_files: dict = {}


def closed_within(s: socket.socket, seconds: float) -> bytes:
    """What s received until the server closed it; fails if it stays open."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
    except socket.timeout:
        pytest.fail(f"still open after {seconds} s (got {got!r})")


def scrape(srv, timeout: float = 5.0) -> requests.Response:
    host, port = srv.server_address
    with requests.Session() as http:
        http.trust_env = False
        return http.get(f"http://{host}:{port}/metrics", timeout=timeout)


def test_idle_connections_do_not_hold_scrapes_and_are_closed(start):
    srv, _ = start(header_timeout=3.0)
    with connections(srv, 2000) as idle:
        t = time.monotonic()
        r = scrape(srv)
        assert r.status_code == 200 and "nettap_test_events_total 3.0" in r.text
        assert time.monotonic() - t < 5
        deadline = time.monotonic() + 15
        left = 2000
        with selectors.DefaultSelector() as sel:     # epoll: select(2) stops at fd 1024
            for s in idle:
                sel.register(s, selectors.EVENT_READ)
            while left and time.monotonic() < deadline:
                for key, _ in sel.select(1.0):
                    assert key.fileobj.recv(1) == b""     # closed without an answer
                    sel.unregister(key.fileobj)
                    left -= 1
        assert left == 0, f"{left} of 2000 idle connections still open"
        assert srv.rejected["header_timeout"] == 2000
        assert 'nettap_http_connections_rejected_total{reason="header_timeout"} 2000.0' in scrape(srv).text


def test_half_sent_request_is_closed_after_the_header_timeout(start):
    srv, _ = start(header_timeout=1.0)
    with connect(srv) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: test\r\n")
        t = time.monotonic()
        assert closed_within(s, 5) == b""
        assert 0.5 < time.monotonic() - t < 3
    with connect(srv) as s:            # a slow client: each byte in time, the whole too late
        t = time.monotonic()
        for b in b"GET /metrics HTTP/1.1\r\nHost: test":
            try:
                s.send(bytes([b]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - t > 5:
                pytest.fail("a trickling client kept its connection for 5 s")
        assert closed_within(s, 5) == b""
    assert srv.rejected["header_timeout"] == 2


def test_http09_is_refused_and_holds_no_worker(start):
    srv, _ = start(workers=1)
    held = []
    for _ in range(3):
        s = connect(srv)
        s.sendall(b"GET /metrics\r\n")
        held.append(s)
    try:
        for s in held:
            assert closed_within(s, 5) == b""
        assert scrape(srv).status_code == 200
        assert srv.rejected["http09"] == 3
    finally:
        for s in held:
            s.close()


def test_200_concurrent_scrapers_are_all_answered(start):
    srv, _ = start()
    go = threading.Barrier(200)
    codes, slow = [], []

    def one():
        for _ in range(3):           # three rounds: three bursts of 200 new connections
            go.wait()
            t = time.monotonic()
            try:
                codes.append(scrape(srv, timeout=10).status_code)
            except requests.RequestException as e:
                codes.append(repr(e))
            if time.monotonic() - t > 5:
                slow.append(time.monotonic() - t)
    threads = [threading.Thread(target=one) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [200] * 600
    assert slow == [], f"{len(slow)} scrapes took over 5 s: {sorted(slow)[-3:]}"


def test_keep_alive_limit(start):
    srv, _ = start(max_requests=3)
    with connect(srv) as s:
        answers = []
        for _ in range(3):
            s.sendall(request())
            answers.append(response(s))
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        assert [b"\r\nConnection: close\r\n" in a for a in answers] == [False, False, True]
        assert closed_within(s, 5) == b""


def test_idle_keep_alive_is_closed_after_the_idle_timeout(start):
    srv, _ = start(idle_timeout=1.0, header_timeout=30.0)
    with connect(srv) as s:
        s.sendall(request())
        assert response(s).startswith(b"HTTP/1.1 200 ")
        t = time.monotonic()
        assert closed_within(s, 5) == b""
        assert time.monotonic() - t > 0.5
    assert srv.rejected["header_timeout"] == 0       # an idle keep-alive ending is no rejection


def test_pipelined_requests_are_all_answered(start):
    srv, _ = start()
    with connect(srv) as s:
        s.sendall(request() + request("/nope") + request())
        assert [response(s).split(b"\r\n")[0] for _ in range(3)] == \
            [b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 200 OK"]


def test_full_queue_is_answered_503_and_counted(start):
    srv, app = start(workers=1, max_queued=1)
    app.gate.clear()
    busy, queued, extra = connect(srv), connect(srv), connect(srv)
    try:
        busy.sendall(request("/stats"))             # holds the one worker at the gate
        time.sleep(0.3)
        queued.sendall(request())
        deadline = time.monotonic() + 5
        while srv._ready.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        extra.sendall(request())
        assert closed_within(extra, 5).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        app.gate.set()
        assert response(busy).startswith(b"HTTP/1.1 200 ")
        assert response(queued).startswith(b"HTTP/1.1 200 ")
        assert 'nettap_http_connections_rejected_total{reason="overload"} 1.0' in scrape(srv).text
    finally:
        for s in (busy, queued, extra):
            s.close()


def test_requests_whose_client_has_gone_are_not_rendered(start):
    """Clients that send a request and close without reading (or reset) are
    skipped when a worker takes their request: not rendered, counted
    client_gone. One still reading is answered."""
    srv, app = start(workers=1)
    app.gate.clear()
    busy, waiting = connect(srv), connect(srv)
    try:
        busy.sendall(request("/stats"))             # holds the one worker at the gate
        time.sleep(0.3)
        deadline = time.monotonic() + 10
        for i in range(20):
            s = connect(srv)
            s.sendall(request("/stats"))
            while srv._ready.qsize() < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)                    # queued for the worker, then the client leaves
            if i % 2:                                # by a reset rather than an end of stream
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            s.close()
        waiting.sendall(request("/stats"))
        while srv._ready.qsize() < 21 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv._ready.qsize() == 21
        app.gate.set()
        assert response(busy).startswith(b"HTTP/1.1 200 ")
        assert response(waiting).startswith(b"HTTP/1.1 200 ")
        assert app.rendered == 2
        assert srv.rejected["client_gone"] == 20
        assert 'nettap_http_connections_rejected_total{reason="client_gone"} 20.0' in scrape(srv).text
    finally:
        for s in (busy, waiting):
            s.close()


def test_past_max_connections_the_oldest_idle_one_is_closed(start):
    srv, _ = start(max_connections=10)
    with connections(srv, 10) as conns:
        time.sleep(0.3)                              # all parked
        conns.append(connect(srv))
        assert closed_within(conns[0], 5) == b""
        conns[-1].sendall(request())
        assert response(conns[-1]).startswith(b"HTTP/1.1 200 ")
        assert srv.rejected["overload"] == 1


def test_headers_past_the_limit_are_answered_431(start):
    srv, _ = start(max_header_bytes=4096)
    with connect(srv) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: test\r\nX-Filler: " + b"a" * 8192)
        assert closed_within(s, 5).startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert srv.rejected["too_large"] == 1


def test_connections_stay_under_half_the_file_limit(start):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
    try:
        srv, _ = start()                              # reads the limit once: 150 waiting at most
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    conns = [connect(srv) for _ in range(150)]
    try:
        time.sleep(0.3)
        conns.append(connect(srv))
        assert closed_within(conns[0], 5) == b""
        assert scrape(srv).status_code == 200
        assert srv.rejected["overload"] == 2          # the first, then the second for the scrape's
    finally:
        for s in conns:
            s.close()


def test_a_wrong_password_flood_is_throttled_and_scrapes_go_on(monkeypatch):
    """300 connections each pipelining 50 requests with wrong passwords,
    never reading: bcrypt runs for at most the failed checks' CPU share (each
    refused connection ends with its answer), the rest is answered 429
    unhashed and counted, and a scraper whose password was checked before
    is answered throughout."""
    import base64
    import bcrypt
    from exporter.web import throttle, webconfig
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10)).decode()       # the toolkit's usual cost
    web = webconfig.Web(webconfig.parse({"basic_auth_users": {"p": hashed}}))
    calls, real = [0], bcrypt.checkpw

    def checkpw(pw, h):
        calls[0] += 1
        return real(pw, h)
    monkeypatch.setattr(bcrypt, "checkpw", checkpw)
    app = App()
    srv = serve("127.0.0.1:0", app.registry, app.stats, app.not_ready, web)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
        assert requests.get(url, auth=("p", "s3cret"), timeout=10).status_code == 200     # checked, cached
        t0 = time.monotonic()
        flood = []
        for i in range(300):
            s = connect(srv)
            auth = base64.b64encode(f"p:wrong-{i}".encode()).decode()
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {auth}\r\n\r\n".encode() * 50)
            flood.append(s)
        slowest = 0.0
        for _ in range(20):
            t = time.monotonic()
            assert requests.get(url, auth=("p", "s3cret"), timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - t)
        deadline = time.monotonic() + 30
        while sum(srv.rejected[r] for r in ("unauthorized", "auth_throttled")) < 300:
            assert time.monotonic() < deadline, srv.rejected
            time.sleep(0.01)
        took = time.monotonic() - t0
        for s in flood:
            s.close()
        assert srv.rejected["auth_throttled"] > 0
        assert srv.rejected["unauthorized"] + srv.rejected["auth_throttled"] == 300     # one answer each
        # at most the burst plus the share of the time taken, at >= 10 ms a cost-10 check
        assert calls[0] - 1 <= (throttle.FAILED_CPU_BURST + throttle.FAILED_CPU_SHARE * took) / 0.01 + 1
        assert slowest < 5, slowest          # each scrape answered (the figure: bench/http_load.py)
    finally:
        srv.shutdown()
        srv.server_close()


def test_clients_that_do_not_read_hold_no_worker_and_are_closed_at_the_write_timeout(start):
    """16 connections with a 1 KiB receive buffer pipelining requests for a
    1 MiB answer and never reading: with 2 workers, scrapes beside them are
    answered at once; each stalled connection is closed at the write
    timeout and counted, and nothing is written to it after (no 500)."""
    srv, app = start(workers=2, write_timeout=1.0)
    from prometheus_client import Gauge
    g = Gauge("nettap_test_wide", "Many series.", ["i"], registry=app.registry)
    for i in range(2000):                      # ~1 MiB in long values: cheap to render
        g.labels(f"{i:0500d}").set(i)
    stalled = []
    for _ in range(16):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect(srv.server_address)
        s.sendall(request("/metrics") * 5)
        stalled.append(s)
    url = f"http://127.0.0.1:{srv.server_address[1]}/healthz"
    t0 = time.monotonic()
    for _ in range(10):
        assert requests.get(url, timeout=10).status_code == 200
    took = time.monotonic() - t0
    deadline = time.monotonic() + 20
    while srv.rejected["write_timeout"] < 16:
        assert time.monotonic() < deadline, srv.rejected
        time.sleep(0.05)
    assert took < 5, took                      # 10 scrapes, no wait on the stalled clients (~1 s each before)
    for s in stalled:                          # what each got: answers (what the buffers held), then the end
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except ConnectionResetError:
            pass
        assert got.count(b"HTTP/1.1 ") == got.count(b"HTTP/1.1 200 OK\r\n") < 5
        s.close()
    assert srv._unsent == 0
