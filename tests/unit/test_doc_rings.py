"""Every list of rings in the docs names every ring nettap has: those of
exporter/config.py (DEFAULT_RING_BYTES, the rings section's keys), which are
bpf/tcp.h's. A list is three ring names or more one after the other with
nothing but list punctuation, numbers or table columns between them: a
sentence's `a`, `b` and `c`, a `a|b|c` choice, a JSON object's keys, the rows
of an output's table."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.config import DEFAULT_RING_BYTES
from exporter.kernel.tcp_h import RINGS

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("mixin/dashboards/*.md")])
NAME = re.compile(r"(?<![\w.\-/])(" + "|".join(map(re.escape, RINGS)) + r")(?![\w\-/])")
# What may stand between two names of one list: quotes, commas, bars, colons, brackets, numbers,
# percentages, white space (newlines: a table's rows), a list item's dash, and one "and" or "or".
_PUNCT = r"[\s`\"',|:()\[\]{}0-9.%+*\-]*"
SEPARATOR = re.compile(rf"{_PUNCT}(?:\b(?:and|or)\b{_PUNCT})?")


def lists(text: str):
    """(line, [names]) of each run of three ring names or more."""
    out, run, end = [], [], None
    for m in NAME.finditer(text):
        if run and SEPARATOR.fullmatch(text[end:m.start()]):
            run.append(m)
        else:
            if len(run) >= 3:
                out.append(run)
            run = [m]
        end = m.end()
    if len(run) >= 3:
        out.append(run)
    return [(text.count("\n", 0, r[0].start()) + 1, [m.group(1) for m in r]) for r in out]


def test_the_config_and_the_kernel_have_the_same_rings():
    assert tuple(DEFAULT_RING_BYTES) == RINGS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_list_of_rings_names_every_ring(doc):
    for line, names in lists(doc.read_text()):
        assert set(names) == set(DEFAULT_RING_BYTES), (
            f"{doc.relative_to(ROOT)}:{line} lists the rings {names}; nettap has {list(DEFAULT_RING_BYTES)}")


def test_the_lists_are_found():
    """The places the docs list rings: found, so the test above checks them."""
    found = {(p.name, tuple(n)) for p in DOCS for _, n in lists(p.read_text())}
    for doc, first in [("metrics.md", "capture_chunks"),       # the ring label's values
                       ("capture.md", "capture_chunks"),       # the clock line's drops, --decode --ring
                       ("endpoint.md", "capture_chunks"),      # the landing page's rings
                       ("operator-tools.md", "capture_chunks"),    # nettap top's rings
                       ("records.md", "capture_chunks")]:      # NETTAP_RING_*
        assert any(d == doc and names[0] == first for d, names in found), doc
    assert sum(d == "capture.md" for d, _ in found) >= 2


def test_what_is_a_list():
    assert [n for _, n in lists("`ring` ∈ `capture_chunks`, `logs`, and `dns`.")] == [
        ["capture_chunks", "logs", "dns"]]
    assert [n for _, n in lists('{"capture_chunks":0,"logs":3,"dns":0}')] == [["capture_chunks", "logs", "dns"]]
    assert [n for _, n in lists("capture_chunks  0.0 %  0  8388608  0\nlogs  1.0 %\ndns  0\n")] == [
        ["capture_chunks", "logs", "dns"]]
    # prose naming rings apart is no list; a key or a path is no ring name
    assert lists("chunks go to `capture_chunks`, ends to `capture_eof` and problems to `logs`") == []
    assert lists("`rings.capture_chunks`, `rings.logs`, `rings.dns`, capture.dns") == []
