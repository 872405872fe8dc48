"""The Prometheus text format (0.0.4 and 1.0.0) and OpenMetrics 1.0.0, byte for
byte as the client library's ``generate_latest`` functions write them, at a
fraction of their cost per sample line.

A scrape of a node-wide view writes ~1,000 lines; the client library builds
each line's label set anew (a sort, three escapes a value, a format; since
0.21 a name check and escape per sample too), 4.5 µs a text line and 8.5 µs an
OpenMetrics line here with 0.26, 2.7 and 2.6 µs with 0.20. Series are the same
from one scrape to the next, so the text before each value (``name{labels} ``)
is kept from the last scrape of the same format and escaping, built by the
library's own escaping functions, and only the value is written. The kept
texts are those of the last scrape only (series that go are forgotten at the
next one). Which format a scraper gets is the library's choice
(``choose_encoder``: Prometheus asks for OpenMetrics first); what this module
does not write (OpenMetrics 2.0's native histograms) the library writes.
tests/unit/test_exposition.py checks every format against the library's.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Dict, List, Tuple

from prometheus_client import exposition as text_lib
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as om_lib
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.utils import floatToGoString
from prometheus_client.validation import _is_valid_legacy_metric_name

# The client library's munging of OpenMetrics types into the text format.
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_SUFFIXES = ("_created", "_gsum", "_gcount")   # OpenMetrics samples, put in a gauge after their family


class _Library(Exception):
    """What only the library writes (a native histogram): it renders the whole scrape."""


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: dict, escaping: str) -> str:
    return ",".join(f'{escape_label_name(k, escaping)}="{_escape_value(v)}"' for k, v in sorted(labels.items()))


def _text_prefix(name: str, labels: dict, escaping: str) -> str:
    """``name{k="v",...} ``: the text format's sample_line up to the value."""
    labelstr = _labels(labels, escaping) if labels else ""
    escaped = escape_metric_name(name, escaping)
    if escaping != ALLOWUTF8 or _is_valid_legacy_metric_name(name):
        return f"{escaped}{{{labelstr}}} " if labelstr else escaped + " "
    return "{" + escaped + ("," if labelstr else "") + labelstr + "} "


def _om_prefix(name: str, labels: dict, escaping: str) -> str:
    """The same for OpenMetrics (its sample name escaped as the library does, as a label name)."""
    legacy = escaping != ALLOWUTF8 or _is_valid_legacy_metric_name(name)
    labelstr = "" if legacy else escape_metric_name(name, escaping) + ("," if labels else "")
    if labels:
        labelstr += _labels(labels, escaping)
    if labelstr:
        labelstr = "{" + labelstr + "}"
    return (om_lib._escape(name, escaping, om_lib._is_legacy_labelname_rune) if legacy else "") + labelstr + " "


def _value(v) -> str:
    """floatToGoString, with its common case (a finite number Python writes
    without an exponent, below 10^6) written here."""
    f = float(v)
    r = repr(f)
    if -1e6 < f < 1e6 and "e" not in r:     # neither inf nor nan, no exponent, none to add
        return r
    return floatToGoString(f)


def _sample(s, seen: dict, kept: dict, build, escaping: str) -> str:
    """``name{labels} value``: the text before the value as the last scrape
    kept it (or this one, a series given twice), else built."""
    key = (s.name, *s.labels.items())
    prefix = seen.get(key) or kept.get(key)
    if prefix is None:
        prefix = build(s.name, s.labels, escaping)
    seen[key] = prefix
    return prefix + _value(s.value)


class TextRenderer:
    """The library's generate_latest functions with the label texts of the
    last scrape kept, per format and escaping. One per registry; safe when
    scrapes overlap (each builds its own new table and the last one in is kept)."""

    def __init__(self):
        self._kept: Dict[Tuple[str, str], Dict[Tuple, str]] = {}
        self._lock = threading.Lock()

    def _keep(self, fmt: str, seen: Dict[Tuple, str]) -> None:
        with self._lock:
            self._kept[fmt] = seen

    def render(self, registry, escaping: str = UNDERSCORES) -> bytes:
        """The text format, as prometheus_client.exposition.generate_latest."""
        fmt = ("text", escaping)
        kept, seen = self._kept.get(fmt, {}), {}
        out: List[str] = []
        add = out.append
        for metric in registry.collect():
            try:
                name, mtype = metric.name, metric.type
                mname = name
                if mtype == "counter":
                    mname += "_total"
                elif mtype == "info":
                    mname += "_info"
                mtype = _TYPES.get(mtype, mtype)
                doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
                add(f"# HELP {escape_metric_name(mname, escaping)} {doc}\n"
                    f"# TYPE {escape_metric_name(mname, escaping)} {mtype}\n")
                om: Dict[str, List[str]] = {}
                for s in metric.samples:
                    line = _sample(s, seen, kept, _text_prefix, escaping)
                    if s.timestamp is not None:
                        line += f" {int(float(s.timestamp) * 1000):d}"
                    suffix = s.name[len(name):]
                    if suffix and suffix in _SUFFIXES and s.name.startswith(name):
                        om.setdefault(suffix, []).append(line + "\n")
                    else:
                        add(line + "\n")
            except Exception as exception:
                exception.args = (exception.args or ("",)) + (metric,)
                raise
            for suffix, lines in sorted(om.items()):
                gname = escape_metric_name(name + suffix, escaping)
                add(f"# HELP {gname} {doc}\n# TYPE {gname} gauge\n")
                out.extend(lines)
        self._keep(fmt, seen)
        return "".join(out).encode("utf-8")

    def render_openmetrics(self, registry, escaping: str = UNDERSCORES, version: str = "1.0.0") -> bytes:
        """OpenMetrics, as prometheus_client.openmetrics.exposition.generate_latest."""
        try:
            return self._openmetrics(registry, escaping)
        except _Library:
            return om_lib.generate_latest(registry, escaping=escaping, version=version)

    def _openmetrics(self, registry, escaping: str) -> bytes:
        fmt = ("openmetrics", escaping)
        kept, seen = self._kept.get(fmt, {}), {}
        out: List[str] = []
        add = out.append
        for metric in registry.collect():
            try:
                mname = escape_metric_name(metric.name, escaping)
                add(f"# HELP {mname} {_escape_value(metric.documentation)}\n# TYPE {mname} {metric.type}\n")
                if metric.unit:
                    add(f"# UNIT {mname} {metric.unit}\n")
                for s in metric.samples:
                    if s.native_histogram or s.value is None:
                        raise _Library()
                    line = _sample(s, seen, kept, _om_prefix, escaping)
                    if s.timestamp is not None:
                        line += f" {s.timestamp}"
                    if s.exemplar:
                        line += om_lib._compose_exemplar_string(metric, s, s.exemplar)
                    add(line + "\n")
            except _Library:
                raise
            except Exception as exception:
                exception.args = (exception.args or ("",)) + (metric,)
                raise
        add("# EOF\n")
        self._keep(fmt, seen)
        return "".join(out).encode("utf-8")

    def encoder(self, accept: str):
        """(encoder, content type) for an Accept header, as the library
        negotiates them, the encoder this renderer's where it writes that
        format (the text format's versions, OpenMetrics 1.0.0)."""
        encoder, ctype = choose_encoder(accept)
        func, kw = getattr(encoder, "func", encoder), getattr(encoder, "keywords", {})
        if func is text_lib.generate_latest:
            return partial(self.render, escaping=kw.get("escaping", UNDERSCORES)), ctype
        if func is om_lib.generate_latest and kw.get("version") == "1.0.0":
            return partial(self.render_openmetrics, escaping=kw.get("escaping", UNDERSCORES)), ctype
        return encoder, ctype
