"""End-to-end: the real exporter, scraped by a real Prometheus."""
import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests

from exporter.kernel import dns, gotls, loader, mechanisms, nodewalk, tls
from exporter.kernel.tcp_h import RINGS
from procs import Nettap, Prometheus, held_programs, loaded_programs, stats_held_elsewhere, wait_for
from traffic import Server, send_messages

pytestmark = pytest.mark.e2e


def expected_programs() -> int:
    """Programs a default nettap holds on this kernel, as the loader's own
    probing decides: the lifecycle programs (the separately reported ones where the kernel has
    what they need), each probe's programs, and the probe program that asks whether BPF
    statistics are on (exporter/kernel/bpfstats.py), and the TLS and DNS programs where they are
    loaded at start (the default config has capture.tls and capture.dns off: they are loaded at
    start only by a nettap that could not load them later, without CAP_SYS_ADMIN)."""
    mechanisms.ensure_tracefs()          # as the loader does before it plans (tracepoint ids)
    kp = mechanisms.plan()
    calls = sum(len(loader.programs_for(p, st.mechanism, kp.variant)) for p, st in kp.states.items()
                if st.mechanism != "none")
    # the TLS programs (where the kernel has uprobes) and the DNS programs (of the mechanism the
    # plan chose for them) are loaded at start only by a nettap that could not load them later
    separate = sum(len(progs) for progs, _m in loader.separate_programs(kp.features).values())
    return len(loader.lifecycle_programs()) + separate + 1 + calls \
        + (len(tls.programs(kp.variant) + gotls.programs(kp.variant))
           if tls.supported()[0] and loader.load_at_start(False) else 0) \
        + (len(dns.programs(kp.variant, kp.dns.mechanism))
           if kp.dns.mechanism != "none" and loader.load_at_start(False) else 0)
SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


@pytest.fixture
def stack(tmp_path):
    made = []

    def make(cfg, args=()):
        n = Nettap(tmp_path, cfg, args=args)
        made.append(n)
        p = Prometheus(tmp_path, {"nettap": f"127.0.0.1:{n.port}"})
        made.append(p)
        return n, p
    yield make
    for m in reversed(made):
        m.stop()


def test_seed_queries_return_series_with_expected_labels(stack):
    srv = Server()
    n, prom = stack({"captures": [{"port": srv.port}], "diagnostics": {"bpfStats": {"enabled": True}}})
    for _ in range(3):
        send_messages(srv.port, 20, 500)
        time.sleep(1)
    srv.wait_received(3)
    calls = wait_for(lambda: prom.query('sum by (probe) (rate(nettap_probe_calls_total[1m])) > 0'),
                     what="calls rate")
    assert {r["metric"]["probe"] for r in calls} >= {"tcp_sendmsg", "tcp_recvmsg"}
    drops = prom.query('sum by (ring) (rate(nettap_ringbuf_drops_total[5m]))')
    assert {r["metric"]["ring"] for r in drops} == set(RINGS)
    per_run = wait_for(lambda: prom.query(
        'sum by (program) (rate(nettap_bpf_program_run_time_seconds_total[1m]))'
        ' / (sum by (program) (rate(nettap_bpf_program_runs_total[1m])) > 0)'), what="ns per run")
    assert {"tcp_sendmsg_enter", "tcp_sendmsg_exit"} <= {r["metric"]["program"] for r in per_run}
    assert all(0 < float(r["value"][1]) < 1e-3 for r in per_run)
    assert wait_for(lambda: prom.query('rate(process_cpu_seconds_total{job="nettap"}[1m])'), what="cpu")
    assert prom.query('sum(rate(nettap_bpf_program_run_time_seconds_total[1m]))')


def test_prometheus_scrapes_compressed(stack, tmp_path):
    """Prometheus asks for gzip (Accept-Encoding: gzip on every scrape): it
    gets it, and reads the samples out of it. The debug log line of each
    answer says how it was encoded."""
    n, prom = stack({"captures": []}, args=["--log.level", "debug"])
    wait_for(lambda: prom.query('scrape_samples_scraped{job="nettap"} > 50'), what="samples scraped")
    assert prom.query('nettap_build_info{job="nettap"} == 1') and prom.query('up{job="nettap"} == 1')
    log = (tmp_path / "nettap.log").read_text()
    answers = re.findall(r'GET /metrics HTTP/1\.1\\?" 200 (\d+) (\w+)', log)
    assert answers and all(coding == "gzip" for _, coding in answers), answers


def test_promtool_accepts_the_exposition(tmp_path):
    n = Nettap(tmp_path, {"captures": [{"port": 1}], "diagnostics": {"bpfStats": {"enabled": True, "scope": "node"}}})
    try:
        text = n.metrics_text()
        # Node-wide view: every program nettap holds is listed, under nettap's process name.
        comm = open(f"/proc/{n.p.pid}/comm").read().strip()
        ours = sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("nettap_node_bpf_programs{") and f'owner="{comm}"' in l)
        # ... and the iterator that listed them, where the kernel offers it (loaded by this scrape)
        assert ours >= len(held_programs(n.p.pid)) == expected_programs() + nodewalk.iterator_offered()[0]
        names = {m for m in re.findall(r'nettap_node_bpf_program_runs_total\{[^}]*program="([^"]+)"', text)}
        assert {"tcp_sendmsg_enter_iov", "tcp_state"} <= names and "tcp_sendmsg_ent" not in names  # BTF names
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        om = requests.get(n.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
        stats = requests.get(n.url + "/stats", timeout=5).json()
        assert set(stats["probes"]) == {"tcp_sendmsg", "tcp_recvmsg", "ssl_write", "ssl_read", "ssl_handshake", "dns",
                                     "go_tls_write", "go_tls_read"}
        assert "nettap" in requests.get(n.url + "/", timeout=5).text
        assert requests.get(n.url + "/healthz", timeout=5).status_code == 200
    finally:
        n.stop()


def _bpftool_runs(pid):
    """{program name: run_cnt} from bpftool, for the programs process pid holds."""
    ids = held_programs(pid)
    progs = json.loads(subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True,
                                      text=True, check=True).stdout)
    return {p["name"]: p.get("run_cnt", 0) for p in progs if p["id"] in ids}


def test_stats_switch_live_and_agrees_with_bpftool(stack):
    before = open(SYSCTL).read().strip()
    srv = Server()
    cfg = {"captures": [{"port": srv.port}], "diagnostics": {"bpfStats": {"enabled": False}}}
    n, prom = stack(cfg)
    assert n.sample("nettap_bpf_program_runs_total", program="tcp_sendmsg_enter") is None
    # The kernel's state: on only if another process holds statistics on.
    wait_for(lambda: n.sample("nettap_bpf_stats_enabled") == (1 if stats_held_elsewhere() else 0),
             what="stats state as the kernel has it")

    cfg["diagnostics"]["bpfStats"]["enabled"] = True
    n.write_config(cfg)
    t = time.time()
    wait_for(lambda: prom.query('nettap_bpf_program_runs_total{program="tcp_sendmsg_exit"}'),
             timeout=5, what="program series in Prometheus")
    assert time.time() - t < 3.5        # two 1 s scrapes after a ≤ 1 s reload
    assert n.sample("nettap_bpf_stats_source", source="fd") == 1
    first = n.sample("nettap_bpf_program_runs_total", program="tcp_sendmsg_exit")
    send_messages(srv.port, 30, 100)
    srv.wait_received(1)
    wait_for(lambda: n.sample("nettap_bpf_program_runs_total", program="tcp_sendmsg_exit") >= first + 30,
             what="runs grow with traffic")

    # The same numbers as bpftool for the same programs (read between two bpftool runs).
    lo = _bpftool_runs(n.p.pid)
    ours = {name: n.sample("nettap_bpf_program_runs_total", program=name)
            for name in ("tcp_sendmsg_exit", "tcp_sendmsg_enter_iov", "tcp_state", "tcp_recvmsg_enter")}
    hi = _bpftool_runs(n.p.pid)
    for name, v in ours.items():
        assert lo[name] <= v <= hi[name], (name, lo[name], v, hi[name])
    assert ours["tcp_sendmsg_exit"] >= first + 30

    cfg["diagnostics"]["bpfStats"]["enabled"] = False
    n.write_config(cfg)
    wait_for(lambda: n.sample("nettap_bpf_program_runs_total", program="tcp_sendmsg_exit") is None,
             timeout=3, what="program series gone")
    wait_for(lambda: n.sample("nettap_bpf_stats_enabled") == (1 if stats_held_elsewhere() else 0),
             what="stats state as the kernel has it")
    assert open(SYSCTL).read().strip() == before


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_left_in_the_kernel_after_exit(tmp_path, how):
    before = open(SYSCTL).read().strip()
    n = Nettap(tmp_path, {"captures": [{"port": 1}], "diagnostics": {"bpfStats": {"enabled": True}}})
    try:
        ours = held_programs(n.p.pid)
        assert len(ours) == expected_programs() and ours <= loaded_programs()
    finally:                             # stopped either way: a failed count must not leave it running
        n.stop(how)
    wait_for(lambda: not ours & loaded_programs(), timeout=10, what="programs unloaded")
    # Links hold their programs: with no nettap program left, no link of nettap's is left either.
    assert open(SYSCTL).read().strip() == before


def test_bad_config_refused_old_stays_in_force(tmp_path):
    srv = Server()
    good = {"captures": [{"port": srv.port}]}
    n = Nettap(tmp_path, good)
    try:
        assert n.sample("nettap_config_last_reload_successful") == 1
        bad = [": : not yaml [", "captures: [{port: http}]", "bogus: 1",
               "captures: [{cgroup: /sys/fs/cgroup/unified/does-not-exist}]",
               "captures: [{netns: /var/run/netns/does-not-exist}]"]
        for i, text in enumerate(bad):
            n.cfg_path.write_text(text)
            wait_for(lambda i=i: n.sample("nettap_config_reloads_total", result="failure") == i + 1,
                     timeout=3, what=f"reload of {text!r} refused")
            assert n.sample("nettap_config_last_reload_successful") == 0
        log = (tmp_path / "nettap.log").read_text()
        assert "captures[0].port: must be an integer" in log and "bogus: unknown key" in log
        assert "does-not-exist" in log
        # The old captures still work.
        send_messages(srv.port, 5, 100)
        srv.wait_received(1)
        assert n.sample("nettap_probe_calls_total", probe="tcp_sendmsg") == 5
        # SIGHUP reloads a good file again.
        n.write_config(good)
        n.p.send_signal(signal.SIGHUP)
        wait_for(lambda: n.sample("nettap_config_last_reload_successful") == 1, timeout=3, what="good reload")
    finally:
        n.stop()


def test_configmap_symlink_swap_applies_within_two_seconds(tmp_path):
    """Kubernetes updates a mounted ConfigMap by swapping the ..data link."""
    d = tmp_path / "cm"
    d.mkdir()
    srv = Server()

    def publish(version, cfg):
        v = d / f"..{version}"
        v.mkdir()
        (v / "nettap.yaml").write_text(json.dumps(cfg))
        tmp = d / "..data_tmp"
        os.symlink(v.name, tmp)
        os.replace(tmp, d / "..data")

    publish("v1", {"captures": [{"port": 1}]})
    os.symlink("..data/nettap.yaml", d / "nettap.yaml")
    n = Nettap(tmp_path, None, config_path=d / "nettap.yaml")
    try:
        publish("v2", {"captures": [{"port": srv.port}]})
        t = time.time()
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="success") == 2,
                 timeout=2, step=0.05, what="reload after the swap")
        assert time.time() - t <= 2
        send_messages(srv.port, 4, 100)
        srv.wait_received(1)
        assert n.sample("nettap_probe_calls_total", probe="tcp_sendmsg") == 4
    finally:
        n.stop()


def test_ring_size_change_on_reload_says_it_applies_at_next_start(tmp_path):
    """A BPF ring cannot be resized while loaded: a reload that changes rings.*
    applies the rest, says in the log which rings wait for the next start, and
    nettap_config_restart_pending shows it until the file asks for the running sizes again."""
    srv = Server()
    n = Nettap(tmp_path, {"captures": [{"port": 1}]})
    try:
        assert n.sample("nettap_config_restart_pending") == 0
        n.write_config({"captures": [{"port": srv.port}], "rings": {"capture_eof": 4 << 20}})
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="success") == 2, timeout=3,
                 what="reload with a new ring size")
        assert n.sample("nettap_config_restart_pending") == 1
        assert n.sample("nettap_ringbuf_capacity_bytes", ring="capture_eof") == 2 << 20
        log = (tmp_path / "nettap.log").read_text()
        assert "rings: capture_eof 2097152 -> 4194304 bytes take effect at the next start" in log
        send_messages(srv.port, 3, 100)                 # the new captures are in force
        srv.wait_received(1)
        assert n.sample("nettap_probe_calls_total", probe="tcp_sendmsg") == 3
        n.write_config({"captures": [{"port": srv.port}]})
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="success") == 3, timeout=3,
                 what="reload back to the running sizes")
        assert n.sample("nettap_config_restart_pending") == 0
    finally:
        n.stop()
