"""`nettap top` and `nettap size` against a bad server on loopback: a
trickling answer ends at the deadline, unexpected JSON and huge error
pages give one short line (never a traceback), and what the server says
reaches the terminal with its control characters escaped."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console

from exporter.commands import size, top
from exporter.util.httpget import FetchError, get


@pytest.fixture
def server():
    """serve(status, body, trickle=False) -> base URL of a server answering
    every GET so (trickle: a byte every 0.1 s, forever)."""
    servers = []

    def serve(status=200, body=b"", trickle=False, stall=False):
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) if not trickle else 1 << 30))
                self.end_headers()
                try:
                    if stall:                      # headers, then nothing
                        self.wfile.flush()
                        time.sleep(30)
                        return
                    if trickle:
                        while True:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.1)
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *a):
                pass
        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"
    yield serve
    for s in servers:
        s.shutdown()
        s.server_close()


def test_a_trickling_answer_ends_at_the_deadline(server):
    url = server(trickle=True)
    t = time.monotonic()
    with pytest.raises(FetchError, match=r"no whole answer within 1 s$"):
        get(url, deadline=1.0)
    assert time.monotonic() - t < 3
    t = time.monotonic()
    view, why = top.fetch(url + "/metrics", timeout=0.5)
    assert view is None and "no whole answer within 0.5 s" in why and time.monotonic() - t < 2


def test_a_body_that_never_comes_is_one_short_error(server):
    url = server(body=b"x" * 100, stall=True)
    t = time.monotonic()
    with pytest.raises(FetchError, match=r"^cannot reach .* \(\w+\)$"):
        get(url, deadline=1.0)
    assert time.monotonic() - t < 5


def test_an_answer_past_the_size_cap_is_refused(server):
    url = server(body=b"x" * (3 << 20))
    with pytest.raises(FetchError, match="larger than 1048576 bytes"):
        get(url, max_bytes=1 << 20)


@pytest.mark.parametrize("status, body", [
    (200, b"[1,2,3]"), (200, b'{"status": "success"}'), (200, b"NaN"), (200, b"null"),
    (200, b"[" * 100_000), (200, b'{"status": "success", "data": {"result": [{"metric": {}, "value": ["x"]}]}}'),
    (200, b'{"status": "error", "error": "\x1b]0;owned\x07' + b"e" * 1000 + b'"}'),
    (500, b"\x1b[2J" + b"E" * (50 << 20)),
], ids=["list", "no-data", "nan", "null", "deep", "short-value", "escape-error", "50MB-error"])
def test_size_says_one_short_line_for_anything_but_the_api(server, capsys, status, body):
    url = server(status, body)
    rc = size.main(["--prometheus", url, "--range", "1m"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert err.startswith("nettap size: ") and err.count("\n") == 1 and len(err) < 600, err[:1000]
    assert "\x1b" not in err and "Traceback" not in err


def test_top_escapes_what_a_server_put_in_label_values(server):
    golden = (__import__("pathlib").Path(__file__).parent / "fixtures/metrics/golden.prom").read_text()
    body = golden.replace("<DURATION>", "0.001").replace('ring="logs"', 'ring="[red]x\\u001b]0;owned\\u0007"')
    body = body.replace('ring="[red]x\\u001b]0;owned\\u0007"', 'ring="[red]x\x1b]0;owned\x07"')
    url = server(200, body.encode())
    cur, why = top.fetch(url + "/metrics")
    assert why is None, why
    view = top.nettap_view(url, cur, cur, 1.0)
    c = Console(record=True, width=200, color_system=None)
    c.print(top.render([], view, "runs", False, "s", live=False))
    out = c.export_text()
    assert "\x1b" not in out and "[red]x\\x1b]0;owned\\x07" in out
