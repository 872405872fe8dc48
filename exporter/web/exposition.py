"""The Prometheus text format (0.0.4), byte for byte as the client library's
``generate_latest`` writes it, at a fraction of its cost per sample line.

A scrape of a node-wide view writes ~1,000 lines; the client library builds
each line's label set anew (a sort, three escapes a value, a format), about
2 µs a line here. Series are the same from one scrape to the next, so the
text before each value (``name{labels} ``) is kept from the last scrape and
only the value is written. The kept texts are those of the last scrape only
(series that go are forgotten at the next one). OpenMetrics, when asked, is
still the client library's.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Tuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE, choose_encoder
from prometheus_client.utils import floatToGoString


# The client library's munging of OpenMetrics types into the text format.
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_SUFFIXES = ("_created", "_gsum", "_gcount")   # OpenMetrics samples, put in a gauge after their family


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _prefix(name: str, labels: dict) -> str:
    """``name{k="v",...} ``: the client library's label text."""
    if not labels:
        return name + " "
    return name + "{" + ",".join(
        '{}="{}"'.format(k, v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\""))
        for k, v in sorted(labels.items())) + "} "


def _value(v) -> str:
    """floatToGoString, with its common case (a finite number Python writes
    without an exponent, below 10^6) written here."""
    f = float(v)
    r = repr(f)
    if -1e6 < f < 1e6 and "e" not in r:     # neither inf nor nan, no exponent, none to add
        return r
    return floatToGoString(f)


class TextRenderer:
    """generate_latest with the label texts of the last scrape kept. One
    per registry; safe when scrapes overlap (each builds its own new table
    and the last one in is kept)."""

    def __init__(self):
        self._kept: Dict[Tuple, str] = {}
        self._lock = threading.Lock()

    def render(self, registry) -> bytes:
        kept = self._kept
        seen: Dict[Tuple, str] = {}
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
                doc = _escape_help(metric.documentation)
                add(f"# HELP {mname} {doc}\n# TYPE {mname} {mtype}\n")
                om: Dict[str, List[str]] = {}
                for s in metric.samples:
                    key = (s.name, *s.labels.items())
                    prefix = seen.get(key) or kept.get(key)
                    if prefix is None:
                        prefix = _prefix(s.name, s.labels)
                    seen[key] = prefix
                    line = prefix + _value(s.value)
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
                add(f"# HELP {name}{suffix} {doc}\n# TYPE {name}{suffix} gauge\n")
                out.extend(lines)
        with self._lock:
            self._kept = seen
        return "".join(out).encode("utf-8")

    def encoder(self, accept: str):
        """(encoder, content type) for an Accept header: this renderer for the
        text format, the client library's for OpenMetrics."""
        encoder, ctype = choose_encoder(accept)
        if ctype == CONTENT_TYPE:
            return self.render, ctype
        return encoder, ctype
