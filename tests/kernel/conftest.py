import base64
import json
from collections import defaultdict

import pytest

from exporter import config
from exporter.app import Nettap


class Run:
    """A Nettap loaded in this process with a jsonl sink under tmp_path."""

    def __init__(self, tmp_path, doc):
        self.out = tmp_path / "capture.jsonl"
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out)})
        self.cfg = config.parse(doc)
        self.app = Nettap(self.cfg)

    def counters(self):
        return self.app.counters()

    def drops(self):
        return self.app.drops()

    def apply(self, doc):
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out)})
        self.app.apply(config.parse(doc))

    def finish(self):
        """Stop (last drain, sink flushed) and return the JSON lines."""
        rings = dict(self.app.rings)
        self.app.close()
        drained = {name: r.drained for name, r in rings.items()}
        lines = [json.loads(l) for l in self.out.read_text().splitlines()] if self.out.exists() else []
        return lines, drained


def streams(lines, direction):
    """conn_id -> bytes of that direction, reassembled by offset."""
    parts = defaultdict(list)
    for l in lines:
        if l["type"] == "chunk" and l["direction"] == direction:
            parts[l["conn_id"]].append((l["offset"], base64.b64decode(l["data"])))
    out = {}
    for cid, ps in parts.items():
        ps.sort()
        buf = b""
        for off, d in ps:
            assert off == len(buf), f"conn {cid}: gap or overlap at {off} (have {len(buf)})"
            buf += d
        out[cid] = buf
    return out


@pytest.fixture
def nettap_run(tmp_path):
    runs = []

    def make(doc):
        r = Run(tmp_path, doc)
        runs.append(r)
        return r
    yield make
    for r in runs:
        r.app.close()
