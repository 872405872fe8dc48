"""Kernel tests: the sink across the exporter's life with the real probes:
a reload to a path nettap cannot use is refused, counters survive a sink
swap, and stop accounts for every record the programs published."""
import json
import logging
import os
import threading

import pytest
import yaml
from prometheus_client import generate_latest

from conftest import Run
from exporter.config import ConfigError
from exporter.kernel.maps import PerCpuArray
from exporter.capture.records import PROBE_COUNTER_FIELDS, PROBES
from traffic import ClientProcess, Server, send_messages
from procs import wait_for



def sample(app, name, **labels):
    text = generate_latest(app.registry(with_process=False)).decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith(prefix))



def test_start_with_an_unusable_output_path_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError) as e:
        Run(tmp_path, {"output": {"type": "jsonl", "path": str(tmp_path / "f" / "out.jsonl"), "root": str(tmp_path)}})
    assert str(e.value) == (f"output.path: {tmp_path / 'f'} is not a directory "
                            "(or is a link made after the path was resolved)")


@pytest.mark.parametrize("bad", ["/proc/nettap-test/out.jsonl", "link"])
def test_reload_to_an_unusable_output_path_is_refused(nettap_run, tmp_path, caplog, bad):
    srv = Server()
    run = nettap_run({"captures": [{"port": srv.port}]})
    old_sink, old_cfg = run.app.pipeline.sink, run.app.config
    if bad == "link":
        bad = str(tmp_path / "link.jsonl")
        os.symlink(tmp_path / "victim", bad)
    path = tmp_path / "bad.yaml"
    root = "/proc" if bad.startswith("/proc") else str(tmp_path)
    path.write_text(yaml.safe_dump({"captures": [{"port": 1}], "output": {"type": "jsonl", "path": bad, "root": root}}))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run.app.reload(str(path)) is False
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and msgs[0].startswith(
        "config reload refused, previous config stays in force: output.path: ")
    assert ("cannot create directory /proc/nettap-test" in msgs[0] if bad.startswith("/proc")
            else f"{bad} is a symbolic link" in msgs[0])
    assert sample(run.app, "nettap_config_last_reload_successful") == 0
    assert run.app.config == old_cfg and run.app.pipeline.sink is old_sink
    assert not (tmp_path / "victim").exists()
    send_messages(srv.port, 3, 100)                 # the old captures and sink still work
    srv.wait_received(1)
    lines, _ = run.finish()
    assert sum(l["type"] == "chunk" and l["direction"] == "egress" for l in lines) == 3


def test_sink_counters_do_not_reset_when_the_sink_is_replaced(nettap_run, tmp_path):
    srv = Server()
    run = nettap_run({"captures": [{"port": srv.port}]})
    send_messages(srv.port, 5, 100)
    srv.wait_received(1)
    assert wait_for(lambda: sample(run.app, "nettap_sink_records_written_total", sink="jsonl") >= 5)

    def totals():
        return (sample(run.app, "nettap_sink_records_written_total", sink="jsonl"),
                sample(run.app, "nettap_sink_bytes_written_total", sink="jsonl"))
    seen = [None]

    def settled():          # the same totals twice, 0.2 s apart: the eofs are in
        seen[0], last = totals(), seen[0]
        return seen[0] == last and seen[0]
    before, nbytes = wait_for(settled, timeout=10, step=0.2, what="the first file's totals to settle")
    second = tmp_path / "second.jsonl"
    run.apply({"captures": [{"port": srv.port}],
               "output": {"type": "jsonl", "path": str(second), "root": str(tmp_path)}})
    assert run.app.pipeline.sink.path == str(second)
    assert sample(run.app, "nettap_sink_records_written_total", sink="jsonl") == before
    send_messages(srv.port, 4, 100)
    srv.wait_received(2)
    assert wait_for(lambda: sample(run.app, "nettap_sink_records_written_total", sink="jsonl") >= before + 4)

    # The eofs of the four connections may still be on their way (a line
    # reaches the file before the counters): the counters must come to
    # agree with the file, line for line and byte for byte.
    # Clock lines (once a second) are written but count in no record metric.
    def counted_as_in_the_file():
        records = sample(run.app, "nettap_sink_records_written_total", sink="jsonl") - before
        nbytes_second = sample(run.app, "nettap_sink_bytes_written_total", sink="jsonl") - nbytes
        lines = [line for line in second.read_bytes().splitlines(keepends=True) if b'"type":"clock"' not in line]
        return (records, nbytes_second) == (len(lines), sum(map(len, lines)))
    assert wait_for(counted_as_in_the_file, timeout=10, what="the sink's counters equal to its file")


def test_clock_lines_add_up_to_what_the_kernel_dropped(nettap_run):
    """Issue 26's clock track, with a ring too small for a burst: the clock
    lines' drops, window by window, add up to the kernel's count, the last
    one written at stop, before the stop line."""
    srv = Server()
    run = nettap_run({"captures": [], "rings": {"capture_chunks": 4096}})
    cl = ClientProcess(srv.port, 3000, 100)
    run.apply({"captures": [{"pid": cl.pid}]})
    cl.go()
    srv.wait_received(1)
    drops = run.drops()
    run.finish()
    lines = [json.loads(line) for line in run.out.read_text().splitlines()]
    clocks = [line for line in lines if line["type"] == "clock"]
    assert drops["capture_chunks"] > 0
    assert {r: sum(c["drops"][r] for c in clocks) for r in drops} == drops
    assert [line["type"] for line in lines[-2:]] == ["clock", "stop"]


# With the mechanism nettap picks (what is tested here is user space and the
# filter every mechanism shares; test_capture runs each mechanism).
def test_every_record_published_until_stop_is_written_or_counted_lost(nettap_run):
    """Issue 11: the last drain ran while the programs were still attached,
    so what they published after it was neither written nor counted. Stop
    while traffic flows: every chunk the programs published is drained, and
    every one drained is in the file or counted lost."""
    srv = Server()
    run = nettap_run({"captures": [{"port": srv.port}]})
    counters = os.dup(run.app.probes.map_fds["probe_counters"])   # outlives close()
    pipe, totals = run.app.pipeline, run.app.sink_totals
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            send_messages(srv.port, 20, 100)
    senders = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
    for t in senders:
        t.start()
    try:
        assert wait_for(lambda: run.app.rings["capture_chunks"].drained > 2000)
        lines, drained = run.finish()              # while the senders keep sending
    finally:
        stop.set()
        for t in senders:
            t.join(10)
    try:
        arr = PerCpuArray(counters, len(PROBE_COUNTER_FIELDS), PROBE_COUNTER_FIELDS)
        published = sum(arr.sum(i)["chunks"] for i in range(len(PROBES)))
    finally:
        os.close(counters)
    assert published == drained["capture_chunks"]
    chunks = sum(l["type"] == "chunk" for l in lines)
    lost = pipe.lost["queue"] + pipe.lost["decode"] + totals.lost
    written = totals.written["jsonl"]
    assert written == len(lines)
    assert sum(drained.values()) == written + lost           # every ring: chunks, eofs, states, logs
    assert chunks <= drained["capture_chunks"]
