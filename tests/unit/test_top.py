"""`nettap top`'s rates, sorting and rendering, from fixed samples and the
golden /metrics fixture (no kernel)."""
from pathlib import Path

import pytest
from rich.console import Console

from exporter.commands import top
from exporter.kernel.fdinfo import Holder

# The golden exposition with its placeholder durations filled in, as a nettap serves it.
GOLDEN = (Path(__file__).parent / "fixtures/metrics/golden.prom").read_text().replace("<DURATION>", "0.001")


def sample():
    prev = {7: (b"tcp_sendmsg_exit", 5, 1000, 50_000), 9: (b"xdp_prog", 6, 10, 10_000),
            11: (b"idle", 26, 0, 0)}
    cur = {7: (b"tcp_sendmsg_exit", 5, 3000, 250_000), 9: (b"xdp_prog", 6, 10, 10_000),
           11: (b"idle", 26, 0, 0), 12: (b"new_one", 2, 5, 500)}
    return top.rows(prev, cur, 2.0, {7: Holder(42, "nettap"), 9: Holder(1, "systemd")})


def test_rates_between_two_samples():
    r = {x.id: x for x in sample()}
    assert (r[7].runs, r[7].ns, r[7].cpu) == (1000.0, 100.0, pytest.approx(0.01))   # 200 us in 2 s
    assert r[7].owner == "42/nettap" and r[7].type == "tracepoint" and r[7].name == "tcp_sendmsg_exit"
    assert (r[9].runs, r[9].ns, r[9].cpu) == (0.0, None, 0.0)        # did not run: no ns per run
    assert r[11].owner == "-" and r[11].type == "tracing"
    assert (r[12].runs, r[12].ns, r[12].cpu) == (None, None, None)   # new since the last sample
    assert all(x.runs is None for x in top.rows(None, {7: (b"a", 5, 1, 1)}, 0.0, {}))


def test_sort_numbers_most_first_words_a_to_z_unknowns_last():
    rs = sample()
    assert [x.id for x in top.sort_rows(rs, "cpu")] == [7, 9, 11, 12]
    assert [x.id for x in top.sort_rows(rs, "cpu", reverse=True)] == [9, 11, 7, 12]
    assert [x.name for x in top.sort_rows(rs, "name")] == ["idle", "new_one", "tcp_sendmsg_exit", "xdp_prog"]
    assert [x.id for x in top.sort_rows(rs, "ns")] == [7, 9, 11, 12]
    assert [x.owner for x in top.sort_rows(rs, "owner")][:2] == ["-", "-"]


def test_nettap_rings_and_probes_from_its_endpoint():
    prev = top.parse_metrics(GOLDEN)
    cur = top.parse_metrics(GOLDEN.replace('nettap_probe_calls_total{probe="tcp_sendmsg"} 1200.0',
                                           'nettap_probe_calls_total{probe="tcp_sendmsg"} 1700.0')
                            .replace('nettap_ringbuf_drops_total{ring="capture_chunks"} 3.0',
                                     'nettap_ringbuf_drops_total{ring="capture_chunks"} 13.0'))
    v = top.nettap_view("http://x/metrics", prev, cur, 5.0)
    assert v.error is None and v.version
    assert dict(v.probes) == {"tcp_sendmsg": 100.0, "tcp_recvmsg": 0.0}
    rings = {r: (fill, drops) for r, fill, drops in v.rings}
    assert rings["capture_chunks"] == (4096 / 16777216, 2.0) and rings["logs"] == (0.0, 0.0)
    first = top.nettap_view("http://x/metrics", None, cur, 0.0)        # one sample: no rates yet
    assert all(c is None for _, c in first.probes)
    assert top.nettap_view("u", None, None, 1, "no nettap at u (ConnectError)").error.startswith("no nettap")
    assert "not a nettap" in top.nettap_view("u", None, top.parse_metrics("up 1\n"), 1).error


def text(renderable) -> str:
    c = Console(width=160, record=True, file=open("/dev/null", "w"))
    c.print(renderable)
    return c.export_text()


def test_render_marks_the_sort_column_and_shows_nettap_or_why_not():
    v = top.nettap_view("http://x/metrics", top.parse_metrics(GOLDEN), top.parse_metrics(GOLDEN), 1.0)
    out = text(top.render(sample(), v, "runs", False, "stats: on (held by this view)"))
    assert "4 BPF programs  1,000 runs/s  0.01% of one CPU  stats: on" in out and "q quit" in out
    assert "5:RUNS/S ▼" in out and "1:ID" in out
    lines = out.splitlines()
    row = next(l for l in lines if "tcp_sendmsg_exit" in l).split()
    assert row == ["7", "tcp_sendmsg_exit", "tracepoint", "42/nettap", "1,000", "100", "0.01"]
    assert next(l for l in lines if "new_one" in l).split()[-3:] == ["-", "-", "-"]
    assert "nettap " in out and "capture_chunks" in out and "tcp_recvmsg" in out
    once = text(top.render(sample(), top.NettapView("u", error="no nettap at u (ConnectionError)"),
                           "name", True, "s", live=False))
    assert "NAME ▼" in once and "2:NAME" not in once and "q quit" not in once
    assert "nettap: no nettap at u (ConnectionError)" in once


def test_args():
    a = top._args(["--sort", "ns", "--once"])
    assert (a.sort, a.once, a.url) == ("ns", True, top.DEFAULT_URL)
    with pytest.raises(SystemExit):
        top._args(["--sort", "bogus"])
