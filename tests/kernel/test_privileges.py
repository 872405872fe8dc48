"""nettap (the real CLI) as a non-root user with exactly the capabilities
the README lists, and what stays after attach, as root too."""
import base64
import json
import os
import pwd
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import requests

from exporter.kernel import privileges
from procs import Nettap, wait_for
from traffic import Server, payload, send_messages


N, S = 20, 1000


def documented_caps() -> list:
    """The README's list (exporter/kernel/privileges.py keeps it), for this kernel."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (list(privileges.REQUIRED) + (list(privileges.REQUIRED_BEFORE_5_11) if (major, minor) < (5, 11) else [])
            + (list(privileges.REQUIRED_BEFORE_6_2) if (major, minor) < (6, 2) else []))


def status(pid: int) -> dict:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


@pytest.fixture
def shared_dir():
    """A directory the unprivileged user can read and write (pytest's tmp_path is root's, 0700)."""
    d = tempfile.mkdtemp(prefix="nettap-nonroot-")
    nobody = pwd.getpwnam("nobody")
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def test_non_root_with_the_documented_capabilities(shared_dir, tmp_path):
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in documented_caps())
    wrap = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
            f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", "--"]
    srv = Server()
    out = os.path.join(shared_dir, "capture.jsonl")
    cfg = Path(shared_dir) / "nettap.yaml"
    umask = os.umask(0o022)                          # the config readable by nobody
    output = {"type": "jsonl", "path": out, "root": shared_dir}
    n = Nettap(tmp_path, {"captures": [{"port": srv.port}], "output": output},
               config_path=cfg, wrap=wrap)
    try:
        st = status(n.p.pid)
        assert st["Uid"].split()[1] == str(pwd.getpwnam("nobody").pw_uid)
        # After attach: no capability left but what a reload may use (before
        # Linux 6.2 the required CAP_SYS_ADMIN, which is kept: it switches
        # statistics), and an exec cannot gain any.
        docs = documented_caps()
        kept = privileges.KEEP + (privileges.KEEP_WITH_SYS_ADMIN if "CAP_SYS_ADMIN" in docs else ())
        left = privileges.mask_of([c for c in docs if c in kept])
        assert int(st["CapEff"], 16) == left and int(st["CapPrm"], 16) == left and int(st["CapAmb"], 16) == 0
        assert st["NoNewPrivs"] == "1"
        assert requests.get(n.url + "/readyz", timeout=5).status_code == 200
        assert n.sample("nettap_probe_attached", probe="tcp_state", mechanism="tp_btf") == 1
        # tcp_timer runs for no kind of the default capture.records: left off where a reload
        # could attach it (CAP_SYS_ADMIN kept), else attached for good (records_at_start)
        mech, up = ("disabled", 0) if "CAP_SYS_ADMIN" in docs else ("tp_btf", 1)
        assert n.sample("nettap_probe_attached", probe="tcp_timer", mechanism=mech) == up
        send_messages(srv.port, N, S)
        srv.wait_received(1)
        wait_for(lambda: (n.sample("nettap_sink_records_written_total", sink="jsonl") or 0) > 0,
                 what="records written")
        assert n.sample("nettap_probe_calls_total", probe="tcp_sendmsg") == N
        # A reload still works without the capabilities: targets change through the map fds.
        n.write_config({"captures": [{"port": srv.port}, {"port": 1}], "output": output})
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="success") == 2, what="reload")
        assert n.sample("nettap_config_last_reload_successful") == 1
    finally:
        os.umask(umask)
        assert n.stop() == 0
    lines = [json.loads(l) for l in open(out)]
    sent = b"".join(base64.b64decode(l["data"]) for l in sorted(
        (l for l in lines if l["type"] == "chunk" and l["direction"] == "egress"), key=lambda l: l["offset"]))
    assert sent == payload(N * S)


def test_as_root_only_what_reloads_use_is_kept(tmp_path):
    """Root: CAP_SYS_ADMIN (statistics switched on live), CAP_SYS_PTRACE,
    CAP_DAC_READ_SEARCH and CAP_NET_BIND_SERVICE stay; CAP_BPF, CAP_PERFMON and
    the rest go; switching statistics on by a reload still works."""
    n = Nettap(tmp_path, {"output": {"type": "none"}})
    try:
        want = privileges.mask_of(["CAP_DAC_READ_SEARCH", "CAP_NET_BIND_SERVICE", "CAP_SYS_PTRACE", "CAP_SYS_ADMIN"])
        # Every thread: capabilities are per thread, and the HTTP server's
        # (which parse what clients send) once started before the drop.
        n.metrics_text()                             # a request served: the workers are up
        tasks = privileges.threads(n.p.pid)
        assert len(tasks) > 5                        # the drain, the sink, the server's parking and workers
        assert {tid: (privileges.names(eff), nnp) for tid, (eff, nnp) in tasks.items()} == \
            {tid: (privileges.names(want), 1) for tid in tasks}
        n.write_config({"output": {"type": "none"}, "diagnostics": {"bpfStats": {"enabled": True}}})
        wait_for(lambda: n.sample("nettap_bpf_stats_source", source="fd") == 1, what="stats on by reload")
        # The DNS programs, left out at start (no config asked), are loaded
        # and attached by the reload that turns capture.dns on, after the drop.
        dns = re.search(r'^nettap_probe_attached\{mechanism="(\w+)",probe="dns"\} (\S+)$', n.metrics_text(), re.M)
        assert dns and dns[1] in ("disabled", "unsupported"), dns
        n.write_config({"output": {"type": "none"}, "capture": {"dns": True}})
        if dns[1] == "disabled":
            def attached():
                m = re.search(r'^nettap_probe_attached\{mechanism="(\w+)",probe="dns"\} 1\.0$', n.metrics_text(),
                              re.M)
                return m and m[1] not in ("disabled", "none")
            wait_for(attached, what="dns attached by a reload")
    finally:
        assert n.stop() == 0


def test_without_cap_dac_read_search_the_error_names_it():
    """tracefs mounted 0700 (as here): the one-line error says what is
    missing (it blamed CAP_SYS_ADMIN and a failed mount before)."""
    import subprocess
    import sys
    from exporter.kernel import arch, mechanisms
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in documented_caps() if c != "CAP_DAC_READ_SEARCH")
    p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", "--",
                        sys.executable, "-m", "exporter", "--preflight"],
                       cwd=os.path.dirname(arch.BPF_DIR), capture_output=True, text=True, timeout=60)
    last = (p.stderr.strip().splitlines() or [""])[-1]
    if not mechanisms.tracefs_mounted():
        assert p.returncode == 1 and last == (
            "nettap: cannot prepare tracefs: tracefs is not mounted at /sys/kernel/tracing and mounting it "
            "failed: Operation not permitted (mounting needs root, or CAP_SYS_ADMIN)")
    elif os.stat(mechanisms.TRACEFS).st_mode & 0o005 != 0o005:
        assert p.returncode == 1 and last == (
            "nettap: cannot prepare tracefs: tracefs at /sys/kernel/tracing is mounted but this process may "
            "not read it (mode 0700): nettap needs root, or CAP_DAC_READ_SEARCH, to read tracepoint ids")
    else:                                            # a tracefs anyone may read: not needed
        assert p.returncode == 0, p.stderr


DROP_WITH_A_THREAD = """
import threading
from exporter.kernel import privileges
gate = threading.Event()
t = threading.Thread(target=gate.wait, name="early")
t.start()
try:
    privileges.drop_after_attach()
except OSError as e:
    print(e)
finally:
    gate.set()
"""


DROP_WHILE_A_THREAD_ENDS = """
import threading
from exporter.kernel import privileges
real, calls = privileges.threads, []

def ending():                    # a joined thread still ending in the kernel, for the first three looks
    calls.append(1)
    return {**real(), 1 << 30: (1 << 38, 0)} if len(calls) <= 3 else real()

privileges.threads = ending
privileges.drop_after_attach()
print("dropped after", len(calls), "looks")
"""


def test_a_thread_still_ending_is_waited_for_not_taken_for_one_that_keeps_privileges():
    """A Python thread that join() has returned for is still ending in the
    kernel for a moment: the drop waits for it (a start that had just joined
    its import and probe threads once failed on one). A thread that stays is
    still refused (test_a_thread_started_before_the_drop_fails_it)."""
    import subprocess
    import sys
    from exporter.kernel import arch
    p = subprocess.run([sys.executable, "-c", DROP_WHILE_A_THREAD_ENDS], cwd=os.path.dirname(arch.BPF_DIR),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "dropped after 4 looks\n"


def test_a_thread_started_before_the_drop_fails_it():
    """capset changes the calling thread only: a drop with another thread
    already running must fail, naming the thread, not log success."""
    import subprocess
    import sys
    from exporter.kernel import arch
    p = subprocess.run([sys.executable, "-c", DROP_WITH_A_THREAD], cwd=os.path.dirname(arch.BPF_DIR),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("[Errno 1] threads started before the drop keep their capabilities: "), p.stdout
    assert "(early: CAP_" in p.stdout
