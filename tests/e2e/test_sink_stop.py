"""End-to-end: the real exporter writing to stdout, a pipe nobody reads."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
import yaml

from exporter.capture.pipeline import SINK_STOP_TIMEOUT
from procs import ROOT, free_port, wait_for
from traffic import Server, send_messages

pytestmark = pytest.mark.e2e


def test_sigterm_with_a_stalled_stdout_reader_ends_in_bounded_time(tmp_path):
    """Issue 11: `nettap ... | (sleep 1000)` held SIGTERM until SIGKILL."""
    srv = Server()
    cfg = tmp_path / "nettap.yaml"
    cfg.write_text(yaml.safe_dump({"captures": [{"port": srv.port}], "output": {"type": "stdout"}}))
    port = free_port()
    r, w = os.pipe()                                     # nobody reads r
    with open(tmp_path / "nettap.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "exporter", "--config", str(cfg),
                              "--web.listen-address", f"127.0.0.1:{port}"],
                             cwd=ROOT, stdout=w, stderr=log)
    os.close(w)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(url + "/readyz", timeout=1).status_code == 200, what="nettap ready")
        send_messages(srv.port, 400, 1000)               # ~1,200 chunks: MBs of JSON lines for a 64 KiB pipe
        srv.wait_received(1)

        def stuck():
            text = requests.get(url + "/metrics", timeout=5).text
            drained = float(re.search(r'nettap_ringbuf_records_drained_total\{ring="capture_chunks"\} (\S+)', text)[1])
            m = re.search(r'nettap_sink_records_written_total\{sink="stdout"\} (\S+)', text)
            return drained >= 400 and (float(m[1]) if m else 0) < drained
        wait_for(stuck, what="the sink blocked on the full pipe")
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(SINK_STOP_TIMEOUT + 15)             # before the fix: never, until SIGKILL
        took = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(r)
        srv.close()
    assert rc == 0
    assert took < SINK_STOP_TIMEOUT + 5
    log = (tmp_path / "nettap.log").read_text()
    m = re.search(rf"sink stdout still blocked after {SINK_STOP_TIMEOUT:g} s at stop \(a reader that stopped "
                  r"reading\?\): (\d+) records counted lost", log)
    assert m and int(m[1]) > 0, log


def test_a_restart_and_a_kill_are_gaps_nettap_read_reports(tmp_path):
    """The first line of a run is a start record and the last, at a clean
    stop, a stop record; `nettap read` reports what no nettap captured: from
    a stop to the next start, and from a run that ended without one."""
    import json
    from procs import Nettap
    srv = Server()
    out = tmp_path / "capture.jsonl"
    cfg = {"captures": [{"port": srv.port}], "output": {"type": "jsonl", "path": str(out), "root": str(tmp_path)}}
    for i, how in enumerate((signal.SIGTERM, signal.SIGKILL, signal.SIGTERM)):
        n = Nettap(tmp_path, cfg)
        send_messages(srv.port, 3, 100)
        srv.wait_received(i + 1)
        wait_for(lambda n=n: (n.sample("nettap_sink_records_written_total", sink="jsonl") or 0) >= 6, what="written")
        n.stop(how)
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    kinds = [r["type"] for r in recs]
    assert [k for k in kinds if k in ("start", "stop")] == ["start", "stop", "start", "start", "stop"]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    starts = [r for r in recs if r["type"] == "start"]
    stops = [r for r in recs if r["type"] == "stop"]
    r = subprocess.run([sys.executable, "-m", "exporter", "read", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    gaps = [l for l in r.stdout.splitlines() if l.startswith("capture gap: ")]
    assert gaps == [
        f"capture gap: nothing was captured from the stop at {stops[0]['time']} until the start at {starts[1]['time']}",
        f"capture gap: the run started {starts[1]['time']} (pid {starts[1]['pid']}) has no stop line: it ended "
        f"uncleanly; nothing was captured from its last record until {starts[2]['time']}"]
