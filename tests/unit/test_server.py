"""exporter.web.server: parse_listen, the listen socket (exporter.web.listen),
and the HTTP endpoints served from a background thread on a free loopback port."""
from __future__ import annotations

import gzip
import json
import socket

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter

from exporter import __version__
from exporter.web import listen
from exporter.web.server import gzip_accepted, parse_listen, serve


@pytest.mark.parametrize("addr, want", [
    (":42424", ("", 42424)),
    ("127.0.0.1:9", ("127.0.0.1", 9)),
    ("[::1]:9", ("::1", 9)),
    ("[::]:42424", ("::", 42424)),
    ("localhost:65535", ("localhost", 65535)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
])
def test_parse_listen(addr, want):
    assert parse_listen(addr) == want


@pytest.mark.parametrize("addr", ["", "42424", "localhost", ":", "127.0.0.1:", ":http", ":65536",
                                  ":-1", ":+80", ": 80", "[::1]", "::1]:x", ":4242a",
                                  "::1:9", "[::1:9", "a]:9", ":\u0661\u0662"])
def test_parse_listen_refuses(addr):
    with pytest.raises(ValueError) as e:
        parse_listen(addr)
    assert str(e.value) == f"--web.listen-address: expected HOST:PORT or [IPV6]:PORT, got {addr!r}"


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_bind_listens_where_the_address_says():
    with listen.bind("127.0.0.1:0") as s:
        assert s.family == socket.AF_INET and s.getsockname()[0] == "127.0.0.1"
        socket.create_connection(s.getsockname()[:2], timeout=5).close()     # listening
    with listen.bind(":0") as s:                 # every address: IPv4 too, over IPv6 where there is IPv6
        port = s.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        if _ipv6():
            assert s.family == socket.AF_INET6
            socket.create_connection(("::1", port), timeout=5).close()


def test_bind_refuses_a_port_in_use_and_a_bad_address():
    with listen.bind("127.0.0.1:0") as busy:
        with pytest.raises(OSError) as e:
            listen.bind(f"127.0.0.1:{busy.getsockname()[1]}").close()
        assert e.value.errno == 98                           # EADDRINUSE
    with pytest.raises(ValueError):
        listen.bind("localhost")


def _free_port() -> int:
    with listen.bind("127.0.0.1:0") as s:
        return s.getsockname()[1]


def test_an_address_given_twice_is_refused_naming_it_and_none_stays_bound():
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    with pytest.raises(listen.ListenError) as e:
        listen.bind_all([addr, addr])
    assert str(e.value) == f"cannot listen on {addr}: [Errno 98] Address already in use"
    with pytest.raises(listen.ListenError) as e:                 # parsed before any is bound
        listen.bind_all([addr, "localhost"])
    assert str(e.value) == ("cannot listen on localhost: --web.listen-address: expected HOST:PORT or "
                            "[IPV6]:PORT, got 'localhost'")
    listen.bind(addr).close()                                    # the first was let go


def test_several_listen_addresses_served_by_one_server(http):
    app = App()
    addrs = ["127.0.0.1:0", "127.0.0.1:0"] + (["[::1]:0"] if _ipv6() else [])
    srv = serve(addrs, app.registry, app.stats, app.not_ready)
    try:
        served = srv.addresses
        assert len(served) == len(addrs) and len({a[1] for a in served}) == len(addrs)
        assert listen.described(served).startswith(f"127.0.0.1:{served[0][1]}, 127.0.0.1:{served[1][1]}")
        for host, port, *_ in served:
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            for _ in range(2):                                    # keep-alive on each
                r = http.get(url + "/healthz", timeout=10)
                assert (r.status_code, r.text) == (200, "ok\n")
            assert "nettap_test_events_total 3.0" in gzip.decompress(_raw(url, "/metrics", "gzip")[2]).decode()
    finally:
        srv.shutdown()
        srv.server_close()
    for host, port, *_ in served:                                 # every one closed
        with pytest.raises(OSError):
            socket.create_connection((host, port), timeout=5).close()


def test_serve_on_a_socket_bound_before():
    app = App()
    sock = listen.bind("127.0.0.1:0")
    srv = serve("127.0.0.1:0", app.registry, app.stats, app.not_ready, sock=sock)
    try:
        assert srv.socket is sock and srv.server_address == sock.getsockname()
        r = requests.get(f"http://127.0.0.1:{sock.getsockname()[1]}/healthz", timeout=10)
        assert (r.status_code, r.text) == (200, "ok\n")
    finally:
        srv.shutdown()
        srv.server_close()


class App:
    def __init__(self):
        self.why = "probes not attached"
        self.fail = None
        self.registry = CollectorRegistry()
        c = Counter("nettap_test_events", "Events seen by the test.", registry=self.registry)
        c.inc(3)

    def stats(self):
        if self.fail:
            raise RuntimeError(self.fail)
        return {"probes": {"tcp_sendmsg": {"calls": 7}}, "b": [1, 2]}

    def not_ready(self):
        return self.why

    def landing(self):
        if self.fail:
            raise RuntimeError(self.fail)
        return {"version": __version__, "captures": [{"kind": "cgroup", "value": "/<script>", "gone": False}]}


@pytest.fixture(scope="module")
def served():
    a = App()
    # port 0: the kernel picks a free one
    srv = serve("127.0.0.1:0", a.registry, a.stats, a.not_ready, landing=a.landing)
    host, port = srv.server_address
    yield a, f"http://{host}:{port}"
    srv.shutdown()                   # one server for the module: shutdown waits up to 0.5 s
    srv.server_close()


@pytest.fixture
def app(served):
    a = served[0]
    a.why, a.fail = "probes not attached", None
    return a


@pytest.fixture
def base(served, app):
    return served[1]


@pytest.fixture
def http():
    s = requests.Session()
    s.trust_env = False              # never through a proxy from the environment
    yield s
    s.close()


def test_metrics_text_format(base, http):
    r = http.get(base + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert r.text.startswith("# HELP nettap_test_events_total Events seen by the test.\n"
                             "# TYPE nettap_test_events_total counter\n"
                             "nettap_test_events_total 3.0\n")
    assert "# EOF" not in r.text


def test_metrics_openmetrics(base, http):
    r = http.get(base + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert r.text.startswith("# HELP nettap_test_events Events seen by the test.\n"
                             "# TYPE nettap_test_events counter\n"
                             "nettap_test_events_total 3.0\n")
    assert r.text.endswith("# EOF\n")


def _raw(base, path, encoding, accept="text/plain"):
    """(status, headers, the body as it was sent)."""
    with requests.get(base + path, headers={"Accept-Encoding": encoding, "Accept": accept}, stream=True,
                      timeout=10) as r:
        return r.status_code, r.headers, r.raw.read(decode_content=False)


@pytest.mark.parametrize("accept", ["text/plain", "application/openmetrics-text"])
def test_metrics_gzip_decodes_to_the_plain_answer(base, accept):
    code, plain_headers, plain = _raw(base, "/metrics", "identity", accept)
    gz_code, headers, gz = _raw(base, "/metrics", "gzip", accept)
    assert code == gz_code == 200 and "Content-Encoding" not in plain_headers
    assert headers["Content-Encoding"] == "gzip" and headers["Vary"] == plain_headers["Vary"] == "Accept-Encoding"
    assert headers["Content-Type"] == plain_headers["Content-Type"]
    assert int(headers["Content-Length"]) == len(gz) and gz[:2] == b"\x1f\x8b"
    assert gzip.decompress(gz) == plain and b"nettap_test_events_total 3.0\n" in plain
    head = requests.head(base + "/metrics", headers={"Accept-Encoding": "gzip"}, timeout=10)
    assert head.headers["Content-Encoding"] == "gzip" and head.content == b""


def test_only_the_metrics_are_compressed(base):
    code, headers, body = _raw(base, "/stats", "gzip")
    assert code == 200 and "Content-Encoding" not in headers and json.loads(body)


@pytest.mark.parametrize("header, taken", [
    ("gzip", True), ("GZIP", True), ("x-gzip", True), ("deflate, gzip;q=0.5", True), ("gzip ; q=1.0", True),
    ("gzip;q=0", False), ("gzip;q=0.000", False), ("gzip;q=x", False), ("identity", False), ("*", False),
    ("br, deflate", False), ("", False), (None, False), ("gzipx", False)])
def test_gzip_accepted(header, taken):
    assert gzip_accepted(header) is taken


def test_metrics_with_query_string(base, http):
    r = http.get(base + "/metrics?name[]=x", timeout=10)
    assert r.status_code == 200
    assert "nettap_test_events_total 3.0\n" in r.text


def test_stats_json(base, http):
    r = http.get(base + "/stats", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json"
    assert r.json() == {"probes": {"tcp_sendmsg": {"calls": 7}}, "b": [1, 2]}
    assert r.text == json.dumps(App().stats(), indent=2, sort_keys=True) + "\n"


def test_landing_page(base, http):
    r = http.get(base + "/", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert f"<h1>nettap {__version__}</h1>" in r.text
    for path in ("/metrics", "/stats", "/healthz", "/readyz"):
        assert f'<a href="{path}">{path}</a>' in r.text
    assert "<code>/&lt;script&gt;</code>" in r.text and "<script" not in r.text    # the app's document


def test_landing_error_is_500(base, http, app):
    app.fail = "no rings"
    r = http.get(base + "/", timeout=10)
    assert (r.status_code, r.text) == (500, "error: no rings\n")


def test_healthz(base, http):
    r = http.get(base + "/healthz", timeout=10)
    assert (r.status_code, r.text, r.headers["Content-Type"]) == (200, "ok\n", "text/plain; charset=utf-8")


def test_prometheus_health_paths(base, http, app):
    r = http.get(base + "/-/healthy", timeout=10)
    assert (r.status_code, r.text) == (200, "ok\n")
    r = http.get(base + "/-/ready", timeout=10)
    assert (r.status_code, r.text) == (503, "not ready: probes not attached\n")
    app.why = None
    assert (http.get(base + "/-/ready", timeout=10).status_code, http.get(base + "/readyz", timeout=10).text) == (
        200, "ready\n")


def test_readyz_flips(base, http, app):
    r = http.get(base + "/readyz", timeout=10)
    assert (r.status_code, r.text) == (503, "not ready: probes not attached\n")
    app.why = None
    r = http.get(base + "/readyz", timeout=10)
    assert (r.status_code, r.text) == (200, "ready\n")
    app.why = "drain thread stopped"
    r = http.get(base + "/readyz", timeout=10)
    assert (r.status_code, r.text) == (503, "not ready: drain thread stopped\n")


@pytest.mark.parametrize("path", ["/nope", "/metrics/", "/METRICS", "/favicon.ico"])
def test_unknown_path_404(base, http, path):
    r = http.get(base + path, timeout=10)
    assert (r.status_code, r.text) == (404, "not found\n")


def test_head_has_no_body(base, http):
    r = http.head(base + "/healthz", timeout=10)
    assert (r.status_code, r.headers["Content-Length"], r.content) == (200, "3", b"")


def test_keep_alive_serves_several_requests(base, http):
    assert [http.get(base + p, timeout=10).status_code for p in ("/healthz", "/nope", "/healthz")] == [200, 404, 200]


def test_handler_error_is_500(base, http, app):
    app.fail = "boom"
    r = http.get(base + "/stats", timeout=10)
    assert (r.status_code, r.text) == (500, "error: boom\n")
    assert http.get(base + "/healthz", timeout=10).status_code == 200


def test_serve_ipv6_loopback(http):
    app = App()
    try:
        socket.socket(socket.AF_INET6).close()
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    srv = serve("[::1]:0", app.registry, app.stats, app.not_ready)
    try:
        port = srv.server_address[1]
        r = http.get(f"http://[::1]:{port}/healthz", timeout=10)
        assert (r.status_code, r.text) == (200, "ok\n")
    finally:
        srv.shutdown()
        srv.server_close()
