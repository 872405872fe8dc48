"""exporter.web.exposition: the text formats and OpenMetrics with label
texts kept between scrapes write what the client library's generate_latest
functions write, byte for byte, for every format and escaping the library
negotiates, as series come, go and change."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, StateSetMetricFamily, UnknownMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_TYPE
from prometheus_client.samples import BucketSpan, NativeHistogram

from exporter.web.exposition import TextRenderer

# What scrapers send: Prometheus 2.42's scrape (captured), Prometheus 3's text 1.0.0 with UTF-8 names,
# curl's nothing, and each format and escaping the client library negotiates.
ACCEPTS = [
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "text/plain;version=1.0.0;escaping=allow-utf-8,text/plain;version=0.0.4;q=0.5",
    None, "text/plain", "text/plain; version=0.0.4",
    *(f"text/plain; version=1.0.0; escaping={e}" for e in ("underscores", "dots", "values", "allow-utf-8")),
    "application/openmetrics-text",
    *(f"application/openmetrics-text; version=1.0.0; escaping={e}" for e in ("underscores", "dots", "values",
                                                                             "allow-utf-8")),
]


class Changing:
    """A custom collector whose series and values change with each collect."""

    def __init__(self):
        self.n = 0

    def collect(self):
        self.n += 1
        c = CounterMetricFamily("t_programs_runs", "Runs.\nTwo lines, a \\ too.", labels=["program", "owner"])
        for i in range(self.n % 4, 6):
            c.add_metric([f"prog{i}", 'we"ird\\name\n' if i == 3 else "none"], i * 1e6 + self.n)
        g = GaugeMetricFamily("t_fill", "Fill.", labels=["ring"])
        g.add_metric(["a"], 0.5 * self.n)
        g.add_metric(["b"], float("inf") if self.n % 2 else float("nan"))
        g.add_metric(["c"], -float("inf"), timestamp=1700000000.5)
        g.add_metric(["d"], 123456789012)
        yield c
        yield g
        yield GaugeMetricFamily("t_empty_labels", "No labels.", value=self.n)
        yield UnknownMetricFamily("t_unknown", "Unknown.", value=3)
        s = StateSetMetricFamily("t_state", "State.", value={"on": self.n % 2 == 0, "off": self.n % 2 == 1})
        yield s
        yield GaugeHistogramMetricFamily("t_gh", "Gauge histogram.", buckets=[("1", 2), ("+Inf", 3)], gsum_value=7)
        # names beyond the legacy character set, each escaping's own way; a colon, legal in a metric name only
        u = GaugeMetricFamily("t.dotted_\u00e9", 'Dotted "quoted".', labels=["lab.el", "ok"], unit="")
        u.add_metric(["v", "w"], self.n)
        yield u
        yield GaugeMetricFamily("t.bare", "No labels, not legacy.", value=1)
        yield CounterMetricFamily("t:colon", "Colon.", value=self.n)


def _registry():
    reg = CollectorRegistry()
    Counter("t_requests", "Requests.", ["code"], registry=reg).labels("200").inc(3, exemplar={"trace_id": "a\"b"})
    Gauge("t_bytes", "Bytes.", unit="bytes", registry=reg).set(2 ** 40)
    Gauge("t_temp", "Temp.", registry=reg).set(-1.25)
    Histogram("t_latency", "Latency.", registry=reg).observe(0.3)
    Summary("t_size", "Size.", registry=reg).observe(17)
    Info("t_build", "Build.", registry=reg).info({"version": "1.0", "rev": "a\"b"})
    Enum("t_mode", "Mode.", states=["x", "y"], registry=reg).state("y")
    changing = Changing()
    reg.register(changing)
    return reg, changing


@pytest.mark.parametrize("accept", ACCEPTS)
def test_same_bytes_as_the_client_library_scrape_after_scrape(accept):
    reg, changing = _registry()
    r = TextRenderer()
    ours, ctype = r.encoder(accept)
    library, library_ctype = choose_encoder(accept)
    assert ctype == library_ctype
    for _ in range(8):
        mine = ours(reg)
        changing.n -= 1                  # the same collect again, for the client library
        assert mine.decode() == library(reg).decode()
    assert b'owner="we\\"ird\\\\name\\n"' in mine
    assert r._kept                       # its own renderer, not the library's


def test_prometheus_gets_openmetrics_from_this_renderer():
    r = TextRenderer()
    enc, ctype = r.encoder(ACCEPTS[0])
    assert (enc.func, enc.keywords, ctype) == (r.render_openmetrics, {"escaping": "underscores"},
                                               OM_TYPE + "; escaping=underscores")


def test_only_the_last_scrapes_series_are_kept():
    reg, changing = _registry()
    r = TextRenderer()
    r.render(reg)
    first = {k for k in r._kept["text", "underscores"] if k[0] == "t_programs_runs_total"}
    r.render(reg)                        # n=2: prog0 and prog1 go
    second = {k for k in r._kept["text", "underscores"] if k[0] == "t_programs_runs_total"}
    assert len(first) == 5 and len(second) == 4 and second < first


def test_encoder_keeps_the_library_negotiation():
    r = TextRenderer()
    enc, ctype = r.encoder("text/plain")
    assert (enc.func, ctype) == (r.render, CONTENT_TYPE_PLAIN_0_0_4)
    enc, ctype = r.encoder("application/openmetrics-text; version=1.0.0")
    assert (enc.func, ctype) == (r.render_openmetrics, "application/openmetrics-text; version=1.0.0; "
                                                      "charset=utf-8; escaping=underscores")
    enc, ctype = r.encoder("application/openmetrics-text; version=2.0.0")       # the library's own
    assert ctype.startswith("application/openmetrics-text; version=2.0.0") and enc.func is not r.render_openmetrics


class Native:
    def collect(self):
        h = HistogramMetricFamily("t_native", "Native.")
        h.add_sample("t_native", {}, None, native_histogram=NativeHistogram(3, 6.0, 0, 0.0, 1,
                                                                             pos_spans=[BucketSpan(0, 1)],
                                                                             pos_deltas=[2]))
        yield h
        yield GaugeMetricFamily("t_after", "After.", value=1)


@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=1.0.0",
                                    "application/openmetrics-text; version=2.0.0"])
def test_native_histograms_left_to_the_library(accept):
    reg = CollectorRegistry()
    reg.register(Native())
    ours, _ = TextRenderer().encoder(accept)
    assert ours(reg) == choose_encoder(accept)[0](reg)


def test_values_written_as_the_client_library_writes_them():
    from prometheus_client.utils import floatToGoString

    from exporter.web.exposition import _value
    values = [0, 1, -1, 0.5, 999999, 1000000, 999999.99, 123456789, -123456789, 2**64 - 1, 1e-7, 1e22, -1e22,
              3.14159e-300, float("inf"), float("-inf"), float("nan"), True, 0.1 + 0.2, 17 / 3, 1e6 - 1e-9]
    values += [10 ** k + d for k in range(0, 20) for d in (-1, 0, 1)]
    for v in values:
        assert _value(v) == floatToGoString(v), v
