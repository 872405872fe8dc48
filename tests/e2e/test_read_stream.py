"""`nettap read --nats` against a real nats-server whose stream holds lines
another publisher put there: any client allowed to publish on nettap.*.*
can, so each line that is no record is skipped and counted, as reading the
files counts it, and the rest of the stream is read (issue 45)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from natscluster import NATS_SERVER, NatsCluster
from procs import ROOT

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not installed (scripts/setup.sh test)")]

FIX = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "read"
HOSTILE = [
    b'{"ts_ns":1e999,"type":"chunk"}\n',                  # int(inf): OverflowError
    b"[" * 100_000 + b"]" * 100_000 + b"\n",              # nesting past the stack: RecursionError
    b'{"ts_ns":NaN,"type":"chunk"}\n',
    b'{"ts_ns":"12","type":"eof"}\n',
    b"\xff\xfe not UTF-8\n",
]


def publish(url: str, messages, window: float = 120.0) -> None:
    """Create stream NETTAP (subjects nettap.*.*, as ingest does; the engine's
    duplicate window) and publish (subject, headers, data) in order, a window
    apart when the window is short."""
    import nats
    from nats.js.api import StreamConfig

    async def go():
        nc = await nats.connect(url)
        try:
            js = nc.jetstream(timeout=10)
            await js.add_stream(StreamConfig(name="NETTAP", subjects=["nettap.*.*"], duplicate_window=window))
            for subject, headers, data in messages:
                await js.publish(subject, data, headers=headers)
                if window < 1:
                    await asyncio.sleep(window * 1.5)
        finally:
            await nc.close()
    asyncio.run(go())


def test_hostile_lines_in_the_stream_are_skipped_and_counted(tmp_path):
    good = (FIX / "capture.jsonl.2").read_bytes().splitlines(keepends=True)
    good = [line for line in good if line.startswith(b'{"call_len"')][:2]
    head = {"Nettap-Node": "node-a", "Nettap-File": "1-2", "Nettap-Region": "0-100"}
    msgs = [("nettap.node-a.chunk", {**head, "Nats-Msg-Id": "a"}, b"".join(good))]
    # any publisher: its own node name, and headers of its choosing
    msgs += [("nettap.node-a.chunk", {**head, "Nettap-Region": "\u00b2-3", "Nats-Msg-Id": "b"}, HOSTILE[0]),
             ("nettap.evil.chunk", {"Nettap-Node": "node-a"}, b"".join(HOSTILE[1:]))]
    with NatsCluster(tmp_path / "nats", n=1) as c:
        publish(c.urls[0], msgs)
        p = subprocess.run([sys.executable, "-m", "exporter", "read", "--nats", c.urls[0]], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and "cannot read stream" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith(f"nettap read: skipped {len(HOSTILE)} line(s): "), p.stderr
    assert "2 connection(s) of 2; records: 2 chunk" in p.stdout, p.stdout


def test_a_message_under_a_used_id_hides_nothing(tmp_path):
    """Reading drops a message stored twice (the same id outside the engine's
    window); another publisher's message under an id ingest uses is not
    that: it hid the real one silently (issue 45)."""
    good = (FIX / "capture.jsonl.2").read_bytes().splitlines(keepends=True)
    good = [line for line in good if line.startswith(b'{"call_len"')][:2]
    head = {"Nettap-Node": "node-a", "Nettap-File": "1-2", "Nettap-Region": "0-100",
            "Nats-Msg-Id": "node-a:1-2:0:chunk"}
    msgs = [("nettap.node-a.chunk", head, b"not a record\n"),       # first, under the id ingest will use
            ("nettap.node-a.chunk", head, b"".join(good)),
            ("nettap.node-a.chunk", head, b"".join(good))]            # ingest's own, stored twice: once
    with NatsCluster(tmp_path / "nats", n=1) as c:
        publish(c.urls[0], msgs, window=0.2)
        p = subprocess.run([sys.executable, "-m", "exporter", "read", "--nats", c.urls[0]], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("nettap read: skipped 1 line(s): 1 not JSON"), p.stderr
    assert "2 connection(s) of 2; records: 2 chunk" in p.stdout, p.stdout
