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

from exporter.pipeline import SINK_STOP_TIMEOUT
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
