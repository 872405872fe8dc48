"""exporter.web.exposition: the text format with label texts kept between
scrapes writes what the client library's generate_latest writes, byte for
byte, as series come, go and change."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                    StateSetMetricFamily, UnknownMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from exporter.web.exposition import TextRenderer


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


def _registry():
    reg = CollectorRegistry()
    Counter("t_requests", "Requests.", ["code"], registry=reg).labels("200").inc(3)
    Gauge("t_temp", "Temp.", registry=reg).set(-1.25)
    Histogram("t_latency", "Latency.", registry=reg).observe(0.3)
    Summary("t_size", "Size.", registry=reg).observe(17)
    Info("t_build", "Build.", registry=reg).info({"version": "1.0", "rev": "a\"b"})
    Enum("t_mode", "Mode.", states=["x", "y"], registry=reg).state("y")
    changing = Changing()
    reg.register(changing)
    return reg, changing


def test_same_bytes_as_the_client_library_scrape_after_scrape():
    reg, changing = _registry()
    r = TextRenderer()
    for _ in range(8):
        ours = r.render(reg)
        changing.n -= 1                  # the same collect again, for the client library
        assert ours == generate_latest(reg)
    assert b'owner="we\\"ird\\\\name\\n"' in ours
    assert b"t_fill{ring=\"c\"} -Inf 1700000000500\n" in ours


def test_only_the_last_scrapes_series_are_kept():
    reg, changing = _registry()
    r = TextRenderer()
    r.render(reg)
    first = {k for k in r._kept if k[0] == "t_programs_runs_total"}
    r.render(reg)                        # n=2: prog0 and prog1 go
    second = {k for k in r._kept if k[0] == "t_programs_runs_total"}
    assert len(first) == 5 and len(second) == 4 and second < first


def test_encoder_keeps_openmetrics_for_the_client_library():
    r = TextRenderer()
    enc, ctype = r.encoder("text/plain")
    assert (enc, ctype) == (r.render, CONTENT_TYPE_LATEST)
    enc, ctype = r.encoder("application/openmetrics-text; version=1.0.0")
    assert (enc, ctype) == (om_latest, OM_TYPE)


def test_values_written_as_the_client_library_writes_them():
    from prometheus_client.utils import floatToGoString

    from exporter.web.exposition import _value
    values = [0, 1, -1, 0.5, 999999, 1000000, 999999.99, 123456789, -123456789, 2**64 - 1, 1e-7, 1e22, -1e22,
              3.14159e-300, float("inf"), float("-inf"), float("nan"), True, 0.1 + 0.2, 17 / 3, 1e6 - 1e-9]
    values += [10 ** k + d for k in range(0, 20) for d in (-1, 0, 1)]
    for v in values:
        assert _value(v) == floatToGoString(v), v
