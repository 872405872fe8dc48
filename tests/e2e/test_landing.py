"""End-to-end: the landing page (GET /) of the real exporter, loaded in a
real headless Chromium: its DOM says what /metrics says (version, probes'
mechanisms, rings, statistics), the config path and captures, a refused
reload and its message; the screenshot has the page on it."""
from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from exporter import config
from procs import Nettap, wait_for
from traffic import Server

pytestmark = pytest.mark.e2e

WIDTH, HEIGHT = 1024, 1400
# A path and a port value that are markup: the page must show them as text.
HOSTILE_NAME = "nettap <b>&\"x'.yaml"
HOSTILE_PORT = "<script>document.title='pwned'</script>"


def chromium(tmp: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                        f"--user-data-dir={tmp / 'chromium'}", f"--window-size={WIDTH},{HEIGHT}",
                        *args, url], capture_output=True, text=True, timeout=120, cwd=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


class Page(HTMLParser):
    """The DOM Chromium dumped: each section's text, and its table rows as cell texts."""

    def __init__(self, dom: str):
        super().__init__()
        self.title, self.tags = "", set()
        self.text = {}                      # section id -> its text
        self.rows = {}                      # section id -> [[cell text, ...], ...]
        self._sec = self._row = self._cell = None
        self._in_title = False
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "section":
            self._sec = dict(attrs)["id"]
            self.text[self._sec], self.rows[self._sec] = "", []
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag):
        if tag == "section":
            self._sec = None
        elif tag == "tr" and self._sec:
            self.rows[self._sec].append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self._sec:
            self.text[self._sec] += data
        if self._cell is not None:
            self._cell += data


def load(tmp: Path, url: str) -> Page:
    dom = chromium(tmp, url, "--dump-dom").stdout
    page = Page(dom)
    assert "script" not in page.tags                     # nothing ran, nothing injected
    assert not re.search(r"https?://", dom)              # nothing fetched from elsewhere
    return page


def scraped(n: Nettap, name: str):
    """[(labels, value)] of the metric name, as the running exporter reports it."""
    out = []
    for line in n.metrics_text().splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m[1] or "")), float(m[2])))
    return out


def png_pixels(data: bytes):
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, ihdr
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):            # PNG spec, 9.2: undo the row's filter
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def test_landing_page_in_chromium(tmp_path):
    srv = Server()
    cfg_path = tmp_path / HOSTILE_NAME
    n = Nettap(tmp_path, {"captures": [{"port": srv.port}, {"pid": os.getpid()}],
                          "diagnostics": {"bpfStats": {"enabled": True}}}, config_path=cfg_path)
    try:
        page = load(tmp_path, n.url + "/")
        version = scraped(n, "nettap_build_info")[0][0]["version"]
        assert page.title == f"nettap {version}"
        cfg = page.text["config"]
        assert f"Config file: {cfg_path}" in cfg and "Last reload: success at " in cfg
        assert page.rows["captures"][1:] == [["port", str(srv.port), "in force"],
                                             ["pid", str(os.getpid()), "in force"]]
        # Each probe as nettap_probe_attached reports it on this kernel.
        attached = {lbl["probe"]: (lbl["mechanism"], v) for lbl, v in scraped(n, "nettap_probe_attached")}
        assert attached and {r[0]: r[1] for r in page.rows["probes"][1:]} == {p: m for p, (m, _) in attached.items()}
        for row in page.rows["probes"][1:]:
            assert row[2].startswith("attached" if attached[row[0]][1] == 1 else "not attached")
        # Each ring with its capacity and drops as /metrics has them.
        cap = {lbl["ring"]: int(v) for lbl, v in scraped(n, "nettap_ringbuf_capacity_bytes")}
        drops = {lbl["ring"]: int(v) for lbl, v in scraped(n, "nettap_ringbuf_drops_total")}
        rings = {r[0]: r for r in page.rows["rings"][1:]}
        assert set(rings) == set(cap) and "capture_chunks" in rings
        for ring, row in rings.items():
            assert re.fullmatch(r"\d+\.\d %", row[1]) and row[3] == str(cap[ring]) and row[4] == str(drops[ring])
        # Statistics: on, and held as nettap_bpf_stats_source says.
        source = [lbl["source"] for lbl, v in scraped(n, "nettap_bpf_stats_source") if v == 1]
        assert len(source) == 1
        held = {"fd": "held by this nettap", "sysctl": "switched on by this nettap",
                "external": "held by another process"}[source[0]]
        assert f"Kernel BPF run-time statistics: on, {held}" in page.text["bpf-stats"]
        assert all(p in page.text["links"] for p in ("/metrics", "/stats", "/healthz", "/readyz"))

        shot = tmp_path / "landing.png"
        chromium(tmp_path, n.url + "/", f"--screenshot={shot}")
        w, h, bpp, rows = png_pixels(shot.read_bytes())
        assert (w, h) == (WIDTH, HEIGHT)
        white = b"\xff" * bpp
        inked = sum(row[i:i + bpp] != white for row in rows for i in range(0, len(row), bpp))
        assert 0.005 * w * h < inked < 0.5 * w * h       # text on a white page, neither blank nor a fill
    finally:
        n.stop()
        srv.close()


def test_refused_reload_on_the_page(tmp_path):
    n = Nettap(tmp_path, {"captures": [{"port": 1}]})
    try:
        n.cfg_path.write_text(f'captures: [{{port: "{HOSTILE_PORT}"}}]\n')
        with pytest.raises(config.ConfigError) as refused:     # what the reload's parser says
            config.load(str(n.cfg_path))
        n.p.send_signal(signal.SIGHUP)
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="failure") >= 1,
                 timeout=10, what="the reload refused")
        page = load(tmp_path, n.url + "/")
        cfg = page.text["config"]
        assert "Last reload: failure at " in cfg and "stays in force" in cfg
        assert f"Error: {refused.value}" in cfg and HOSTILE_PORT in cfg
        assert page.title.startswith("nettap ")                 # the injected script did not run
        assert page.rows["captures"][1:] == [["port", "1", "in force"]]    # the old config
    finally:
        n.stop()
