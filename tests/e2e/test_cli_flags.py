"""The real CLI's flags and start-up: flag spellings, the log formats,
the telemetry path, --check-config, the bound address, the start order."""
import json
import subprocess
import sys

import pytest
import requests

from procs import ROOT, Nettap, free_port, wait_for

pytestmark = pytest.mark.e2e


def run(args, **kw):
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, **kw)


def test_old_log_level_spelling_warns_once(tmp_path):
    n = Nettap(tmp_path, {"captures": []}, args=["--log-level", "debug", "--log-level", "info"])
    n.stop()
    log = (tmp_path / "nettap.log").read_text()
    assert log.count("--log-level is deprecated: use --log.level") == 1, log
    assert "level=debug" not in log and "level=info" in log      # the last one given wins


def test_log_level_and_json_format(tmp_path):
    n = Nettap(tmp_path, {"captures": []}, args=["--log.level", "debug", "--log.format", "json"])
    requests.get(n.url + "/metrics", timeout=5)
    n.stop()
    lines = (tmp_path / "nettap.log").read_text().splitlines()
    docs = [json.loads(line) for line in lines]
    assert {"debug", "info"} <= {d["level"] for d in docs}
    assert any(d["msg"].startswith("nettap ") and " listening on " in d["msg"] for d in docs)
    assert "deprecated" not in "".join(lines)


def test_log_level_warn_starts(tmp_path):
    """warn, as Prometheus and its exporters spell it."""
    n = Nettap(tmp_path, {"captures": []}, args=["--log.level", "warn"])
    try:
        assert "nettap_build_info{" in n.metrics_text()
    finally:
        n.stop()
    log = (tmp_path / "nettap.log").read_text()
    assert "level=info" not in log and "invalid choice" not in log, log


def test_logfmt_is_the_default(tmp_path):
    n = Nettap(tmp_path, {"captures": []})
    n.stop()
    lines = (tmp_path / "nettap.log").read_text().splitlines()
    assert lines and all(line.startswith("ts=") and " level=" in line and " msg=" in line for line in lines), lines


def test_telemetry_path(tmp_path):
    n = Nettap(tmp_path, {"captures": []}, args=["--web.telemetry-path", "/x/metrics"])
    try:
        r = requests.get(n.url + "/x/metrics", timeout=5)
        assert r.status_code == 200 and "nettap_probe_calls_total" in r.text
        assert requests.get(n.url + "/metrics", timeout=5).status_code == 404
        assert 'href="/x/metrics"' in requests.get(n.url + "/", timeout=5).text
    finally:
        n.stop()
    r = run(["--web.telemetry-path", "metrics", "--check-config"])
    assert r.returncode == 2 and "--web.telemetry-path must start with '/'" in r.stderr


def test_several_listen_addresses(tmp_path):
    """--web.listen-address repeated: every address served (as the exporter
    toolkit), each named in the start line; one in use refuses the start."""
    import re
    second = free_port()
    n = Nettap(tmp_path, {"captures": []}, args=["--web.listen-address", f"127.0.0.1:{second}"])
    try:
        for port in (n.port, second):
            assert requests.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).text == "ready\n"
            assert "nettap_build_info{" in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        log = (tmp_path / "nettap.log").read_text()
        assert re.search(rf" listening on 127\.0\.0\.1:{n.port}, 127\.0\.0\.1:{second} ", log), log
        r = run(["--web.listen-address", f"127.0.0.1:{free_port()}", "--web.listen-address", f"127.0.0.1:{second}"])
        assert r.returncode == 1
        assert r.stderr.startswith(f"nettap: cannot listen on 127.0.0.1:{second}: [Errno 98] Address already in use")
    finally:
        n.stop()


def test_ingest_telemetry_path_and_listen_addresses(tmp_path):
    """nettap ingest's endpoint takes the daemon's web flags; it serves
    before it reaches an engine (none here)."""
    import gzip
    cfg = tmp_path / "ingest.yaml"
    out = tmp_path / "capture.jsonl"
    cfg.write_text(json.dumps({"output": {"type": "jsonl", "path": str(out), "root": str(tmp_path)},
                               "ingest": {"servers": [f"nats://127.0.0.1:{free_port()}"], "node": "n"}}))
    ports = [free_port(), free_port()]
    with open(tmp_path / "ingest.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "exporter", "ingest", "--config", str(cfg),
                              "--web.telemetry-path", "/x/metrics", *(f"--web.listen-address=127.0.0.1:{port}"
                                                                      for port in ports)],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            for port in ports:
                url = f"http://127.0.0.1:{port}"
                wait_for(lambda u=url: requests.get(u + "/-/healthy", timeout=1).ok, timeout=30, what="ingest up")
                with requests.get(url + "/x/metrics", stream=True, timeout=5) as r:
                    assert r.status_code == 200 and r.headers["Content-Encoding"] == "gzip"
                    assert b"nettap_ingest_connected 0.0" in gzip.decompress(r.raw.read(decode_content=False))
                assert requests.get(url + "/metrics", timeout=5).status_code == 404
        finally:
            p.terminate()
            p.wait(30)


def test_missing_bpf_object_says_so(tmp_path):
    import os
    from exporter.kernel import arch
    r = run(["--web.listen-address", f"127.0.0.1:{free_port()}"],
            env={**os.environ, "NETTAP_BPF_DIR": str(tmp_path)})
    assert r.returncode == 1
    assert r.stderr.strip().endswith(f"no BPF object (reinstall nettap, or set NETTAP_BPF_DIR): "
                                     f"'{tmp_path}/{arch.target()}/tcp.bpf.o'"), r.stderr
    assert "refused" not in r.stderr and "CAP_" not in r.stderr


def test_build_info_has_the_revision(tmp_path):
    n = Nettap(tmp_path, {"captures": []})
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert f'revision="{head}"' in next(line for line in n.metrics_text().splitlines()
                                             if line.startswith("nettap_build_info{"))
    finally:
        n.stop()


@pytest.mark.parametrize("bpf_stats", [True, False])
def test_stats_document(tmp_path, bpf_stats):
    from traffic import Server, send_messages
    srv = Server()
    n = Nettap(tmp_path, {"captures": [{"port": srv.port}], "diagnostics": {"bpfStats": {"enabled": bpf_stats}}})
    try:
        send_messages(srv.port, 20, 100)
        srv.wait_received(1)
        stats = wait_for(lambda: (lambda s: s["ringbuf_records_drained"]["capture_chunks"] >= 20 and s)(
            requests.get(n.url + "/stats", timeout=5).json()), timeout=20, what="records drained")
        metrics = n.metrics_text()
    finally:
        n.stop()
        srv.close()
    assert stats["probes"]["tcp_sendmsg"]["calls"] >= 20
    assert set(stats["ringbuf_drops"]) >= {"capture_chunks", "capture_eof"}
    assert stats["ringbuf_records_drained"]["capture_chunks"] >= 20
    assert stats["bpf_stats_enabled"] is bpf_stats
    progs = stats["bpf_programs"]
    assert progs and all(set(p) == ({"misses", "runs", "run_time_seconds"} if bpf_stats else {"misses"})
                         for p in progs.values())
    for name, p in progs.items():              # the same names and numbers as /metrics, read a moment before
        if bpf_stats:
            line = next(l for l in metrics.splitlines()
                        if l.startswith(f'nettap_bpf_program_runs_total{{program="{name}"}} '))
            assert float(line.split()[-1]) >= p["runs"]
    if bpf_stats:
        assert sum(p["runs"] for p in progs.values()) >= 40 and any(p["run_time_seconds"] > 0 for p in progs.values())
    proc = stats["process"]
    assert proc["resident_memory_bytes"] > 1 << 20 and proc["cpu_seconds_total"] > 0 and proc["open_fds"] > 3


def test_check_config_refuses_what_the_daemon_refuses(tmp_path):
    import os
    gone = subprocess.Popen(["true"])
    gone.wait()
    cases = {f"pid: {gone.pid}": f"captures[0].pid: pid {gone.pid}: no such process",
             "cgroup: /sys/fs/cgroup/no-such-nettap-cgroup": "captures[0].cgroup: ",
             "netns: 4294967295": "captures[0].netns: netns 4294967295: no such network namespace"}
    for target, why in cases.items():
        p = tmp_path / "nettap.yaml"
        p.write_text(f"captures: [{{{target}}}]\n")
        checked = run(["--check-config", "--config", str(p)])
        started = run(["--config", str(p), "--web.listen-address", f"127.0.0.1:{free_port()}"])
        assert checked.returncode == started.returncode == 2, (checked, started)
        assert (checked.stderr == started.stderr
                and checked.stderr.startswith(f"nettap: config refused: {why}")), checked.stderr
    # the output path, as the daemon opens it: what it cannot create, a read-only file system, a link
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], check=True)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "victim")
    try:
        for root, path, why in (
                ("/proc/1", "/proc/1/nope/x.jsonl", "cannot create directory /proc/1/nope: No such file or directory"),
                (ro, f"{ro}/sub/x.jsonl", f"cannot create directory {ro}/sub: Read-only file system"),
                (ro, f"{ro}/x.jsonl", f"cannot create {ro}/x.jsonl: Read-only file system"),
                (tmp_path, f"{tmp_path}/link.jsonl", f"{tmp_path}/link.jsonl is a symbolic link")):
            p.write_text(f"output: {{type: jsonl, path: '{path}', root: '{root}'}}\n")
            checked = run(["--check-config", "--config", str(p)])
            started = run(["--config", str(p), "--web.listen-address", f"127.0.0.1:{free_port()}"])
            assert checked.returncode == started.returncode == 2, (checked, started)
            assert checked.stderr.startswith(f"nettap: config refused: output.path: {why}"), checked.stderr
            assert started.stderr.splitlines()[-1] == checked.stderr.strip(), (checked, started)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert not (tmp_path / "victim").exists()
    p.write_text(f"output: {{type: jsonl, path: '{tmp_path}/new/dirs/x.jsonl', root: '{tmp_path}'}}\n")
    assert run(["--check-config", "--config", str(p)]).stdout == f"{p}: ok\n"
    assert not (tmp_path / "new").exists()                      # made to see, and removed
    p.write_text(f"captures: [{{pid: {os.getpid()}}}, {{port: 80}}]\n")
    assert run(["--check-config", "--config", str(p)]).stdout == f"{p}: ok\n"
    assert run(["--check-config"]).stdout == "no --config, the built-in default config: ok\n"


def _start(args, log):
    return subprocess.Popen([sys.executable, "-m", "exporter", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def test_port_zero_logs_the_port_it_got(tmp_path):
    import re
    with open(tmp_path / "log", "wb") as log:
        p = _start(["--web.listen-address", "127.0.0.1:0"], log)
        try:
            text = wait_for(lambda: (lambda t: " listening on 127.0.0.1:" in t and t)(
                (tmp_path / "log").read_text()), timeout=60, what="listening")
            port = int(re.search(r" listening on 127\.0\.0\.1:(\d+) ", text)[1])
            assert port != 0
            assert requests.get(f"http://127.0.0.1:{port}/readyz", timeout=5).text == "ready\n"
        finally:
            p.terminate()
            p.wait(30)


def test_port_in_use_fails_before_loading(tmp_path):
    import os
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # No BPF object: had nettap loaded first, that would be its error.
        r = run(["--web.listen-address", f"127.0.0.1:{port}"], env={**os.environ, "NETTAP_BPF_DIR": str(tmp_path)})
    assert r.returncode == 1
    assert r.stderr.startswith(f"nettap: cannot listen on 127.0.0.1:{port}: "
                               "[Errno 98] Address already in use"), r.stderr
    assert "attached" not in r.stderr and "BPF object" not in r.stderr


def test_log_says_attached_only_for_what_attached(tmp_path):
    # fentry forced: where the kernel refuses it, the two syscall probes stay unattached
    # (and nettap not ready): the log must count only what attached.
    import re
    port = free_port()
    with open(tmp_path / "log", "wb") as log:
        p = _start(["--web.listen-address", f"127.0.0.1:{port}", "--mechanism", "fentry"], log)
        try:
            wait_for(lambda: " listening on " in (tmp_path / "log").read_text(), timeout=60, what="listening")
            metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        finally:
            p.terminate()
            p.wait(30)
    attached = {probe: mech for mech, probe in re.findall(r'^nettap_probe_attached\{mechanism="(\w+)",probe="(\w+)"\}',
                                                          metrics, re.M)}
    # the call probes, the lifecycle (one probe), the separately reported lifecycle probes
    # ("unsupported" where the kernel lacks what one needs), and the TLS probes ("disabled":
    # capture.tls is off), and dns ("disabled": capture.dns is off)
    from exporter.kernel import dns, gotls, loader, tls
    assert set(attached) == {*loader.PROBES, "tcp_state", *loader.SEPARATE, *tls.PROBES, *gotls.PROBES,
                             dns.PROBE}, metrics
    text = (tmp_path / "log").read_text()
    off = ("unsupported", "disabled")
    up = {p: m for p, m in attached.items() if m not in ("none",) + off}
    can = len([m for m in attached.values() if m not in off])
    if up:
        line = next(l for l in text.splitlines() if " probes attached in " in l)
        assert f"{len(up)} of {can} probes attached in " in line
        assert "(" + ", ".join(f"{p}={m}" for p, m in up.items()) + ")" in line
    else:
        assert " probes attached" not in text and "no probe attached" in text
    assert "probes: " + ", ".join(f"{p}={m}" for p, m in attached.items()) in text
