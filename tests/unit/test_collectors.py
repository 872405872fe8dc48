"""The collectors of exporter.metrics (and the web server's) rendered
as /metrics for a fixed fixture state, compared byte for byte with
tests/unit/fixtures/metrics/golden.prom. No root, no BPF: every kernel read
is a fake or a monkeypatch.

Regenerate the golden (then READ it and check it against docs/metrics.md):
    NETTAP_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_collectors.py -q
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.capture.dns import LATENCY_BUCKETS, Counts
from exporter.capture.records import ERRNO_NAMES, TCP_STATES
from exporter.kernel import bpfstats, fdinfo, tcp_h
from exporter.metrics import buildinfo
from exporter.commands.daemon import ReloadState
from exporter.metrics.tls import TlsFilesCollector
from exporter.metrics.programs import ProgramStatsCollector
from exporter.metrics.cgroup import CgroupCollector
from exporter.metrics.buildinfo import BuildInfoCollector
from exporter.metrics.dns import DnsCollector
from exporter.metrics.guarded import Guarded
from exporter.metrics.lifecycle import LifecycleCollector
from exporter.metrics.maps import MapCollector
from exporter.metrics.pipeline import PipelineCollector
from exporter.metrics.probes import ProbeCollector
from exporter.metrics.reload import ReloadCollector
from exporter.metrics.targets import TargetsCollector
from exporter.metrics.kubernetes import KubernetesCollector
from exporter.kernel.features import Feature
from exporter.kernel.mechanisms import ProbeState
from exporter.web.server import HttpCollector

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "metrics" / "golden.prom"
DOCS = ROOT / "docs" / "metrics.md"
DURATION = "nettap_scrape_collector_duration_seconds"
REVISION = "8fbc8a4c0ffee0ddba11decafbad5eed0ff1ce00"
TOKEN = "<DURATION>"

# ---- the fixture state ------------------------------------------------------

COUNTERS = {
    "tcp_sendmsg": {"calls": 1200, "returns": 1198, "bytes": 5242880, "chunks": 1300},
    "tcp_recvmsg": {"calls": 900, "returns": 900, "bytes": 1048576, "chunks": 260},
}
DROPS = {"capture_chunks": 3, "capture_eof": 0, "logs": 1}


class FakeRing:
    def __init__(self, size: int, pending: int, **by_kind: int):
        self.drained, self.size, self._pending = sum(by_kind.values()), size, pending
        self.kind_drained = np.zeros(32, dtype=np.uint64)
        numbers = {kind: n for n, kind in tcp_h.NAMES["KIND"].items()}
        for kind, n in by_kind.items():
            self.kind_drained[numbers[kind]] = n

    def pending_bytes(self) -> int:
        return self._pending


PROBE_STATES = {
    "tcp_sendmsg": ProbeState("tcp_sendmsg", mechanism="fentry", attached=True),
    # not attached: rendered with mechanism none whatever was tried
    "tcp_recvmsg": ProbeState("tcp_recvmsg", mechanism="kprobe", attached=False, error="attach refused"),
    "tcp_state": ProbeState("tcp_state", mechanism="tp_btf", attached=True),
    # a kernel without its tracepoint: unsupported, not a failure
    "tcp_sk_error": ProbeState("tcp_sk_error", mechanism="unsupported", error="no tracepoint"),
}


def lifecycle_rows():
    """obs_counters rows (bpf/tcp.h NETTAP_OBS_*): two connections' states,
    three resets, errors by number (255: any larger), retransmissions, timers, probes."""
    rows = np.zeros(tcp_h.OBS_ROWS, dtype=np.uint64)
    for old, new in ((7, 2), (2, 1), (10, 3), (3, 1), (1, 7), (1, 7)):     # CLOSE -> SYN_SENT, ...
        rows[tcp_h.OBS_STATES + old * 16 + new] += 1
    rows[tcp_h.OBS_RESETS + tcp_h.DIR_EGRESS] = 1
    rows[tcp_h.OBS_RESETS + tcp_h.DIR_INGRESS] = 2
    rows[tcp_h.OBS_ERRORS + 111] = 3                                       # ECONNREFUSED
    rows[tcp_h.OBS_ERRORS + 104] = 2                                       # ECONNRESET
    rows[tcp_h.OBS_ERRORS + 255] = 1
    rows[tcp_h.OBS_RETRANS + tcp_h.RETRANS_RTO] = 2
    rows[tcp_h.OBS_RETRANS + tcp_h.RETRANS_TLP] = 3
    rows[tcp_h.OBS_SAMPLED] = 7
    at = tcp_h.OBS_TIMERS + tcp_h.TIMER_KEEPALIVE * 16            # keepalives 0, 0, 2 and 300 jiffies behind
    rows[at + 0], rows[at + 2], rows[at + 9], rows[at + 15] = 2, 1, 1, 302
    rows[tcp_h.OBS_WAKEUPS + tcp_h.WAKEUP_WINDOW] = 4
    return rows


def fake_app():
    return SimpleNamespace(
        probes=SimpleNamespace(
            all_states=lambda: dict(PROBE_STATES),
            variant="compat",
            plan=SimpleNamespace(features=[Feature("BPF ring buffer", "5.8", True, "probe"),
                                           Feature("bpf_rdonly_cast", "6.2", False, "vmlinux BTF")])),
        rings={"capture_chunks": FakeRing(16 << 20, 4096, chunk=1557),
               "capture_eof": FakeRing(256 << 10, 0, eof=12),
               "logs": FakeRing(64 << 10, 0, log=2),
               "obs_events": FakeRing(1 << 20, 0, state=40, owner=8, reset=2, error=1, destroy=7,
                                              retransmit=5, timer=4, probe=4)},
        pipeline=SimpleNamespace(lost={"queue": 5, "decode": 1},
                                 sink=SimpleNamespace(name="jsonl", written=1550, errors=2, lost=2,
                                                    bytes_written=421600)),
    )


# name -> (fd, (map_type, key_size, value_size, max_entries), memlock)
MAPS = {
    "capture_config": (101, (2, 4, 16, 1), 4096),          # ARRAY: entries = max_entries
    "capture_conns": (102, (1, 8, 64, 65536), 12288),      # HASH: known live count
    "capture_pids": (103, (1, 4, 1, 1024), 8192),          # HASH: known (what nettap wrote)
    "probe_counters": (104, (6, 4, 32, 2), 8192),          # PERCPU_ARRAY
    "capture_chunks": (105, (27, 0, 0, 16 << 20), 16781312),  # RINGBUF: entries unknown -> absent
}
KNOWN_ENTRIES = {"capture_pids": 1, "capture_conns": 7}

# 9 answered (4 NOERROR, 2 NXDOMAIN, 1 SERVFAIL, 2 FORMERR: a code seen gets its series), 3 timed out
DNS_COUNTS = Counts({"NOERROR": 4, "NXDOMAIN": 2, "SERVFAIL": 1, "FORMERR": 2, "timeout": 3},
                    (1, 3, 5, 6, 7, 8, 8, 9, 9, 9, 9, 9, 9, 9), 0.3125, 2, 1)
OWN_PROGRAMS = {"tcp_sendmsg_fentry": (1200, 3_500_000), "tcp_sendmsg_fexit": (1198, 2_250_000),
                "tcp_state": (40, 120_000)}
NODE_PROGRAMS = [
    (10, b"tcp_sendmsg_fentry", 26, 1200, 3_500_000),
    (11, b"tcp_sendmsg_fexit", 26, 1198, 2_250_000),
    (20, b"sd_devices", 15, 5, 1000),      # two programs with equal labels:
    (21, b"sd_devices", 15, 7, 3000),      # summed into one series, counted as 2
    (22, b"sd_fw_egress", 8, 100, 50_000),
    (30, b"", 1, 9, 700),                  # no name: id30; no holder: owner none
]
HOLDERS = {10: fdinfo.Holder(4242, "nettap"), 11: fdinfo.Holder(4242, "nettap"),
           20: fdinfo.Holder(1, "systemd"), 21: fdinfo.Holder(1, "systemd"),
           22: fdinfo.Holder(1, "systemd")}


class FakeSwitch:
    def __init__(self, src="fd", wanted=True):
        self._src, self.wanted = src, wanted

    def source(self):
        return self._src


@pytest.fixture
def fixture_kernel(monkeypatch):
    monkeypatch.setattr(bpfstats, "own_programs", lambda fds: {p: (*v, 2 if p == "tcp_state" else 0)
                                                               for p, v in OWN_PROGRAMS.items()})
    monkeypatch.setattr(bpfstats, "node_programs", lambda *a: list(NODE_PROGRAMS))
    monkeypatch.setattr(fdinfo, "scan_bpf_holders", lambda proc_root="/proc": dict(HOLDERS))
    memlock = {fd: mem for fd, _, mem in MAPS.values()}
    monkeypatch.setattr(MapCollector, "_memlock", lambda self, fd, mtype: memlock[fd])
    monkeypatch.setattr(buildinfo, "__version__", "0.0.0-test")
    monkeypatch.setattr(buildinfo.platform, "release", lambda: "6.1.0-test")
    monkeypatch.setattr(buildinfo.platform, "python_version", lambda: "3.11.2")
    monkeypatch.setattr(buildinfo.libbpf, "version", lambda: "v1.1")


def fixture_collectors():
    cg = FIXTURES / "cgroup_v2"
    return {
        "probes": ProbeCollector(lambda: COUNTERS, lambda: DROPS),
        "lifecycle": LifecycleCollector(lifecycle_rows, TCP_STATES, ERRNO_NAMES),
        "dns": DnsCollector(lambda: DNS_COUNTS, LATENCY_BUCKETS),
        "pipeline": PipelineCollector(fake_app()),
        "programs": ProgramStatsCollector(FakeSwitch(), lambda: {n: 0 for n in OWN_PROGRAMS},
                                          lambda: "node"),
        "maps": MapCollector(lambda: {n: m[0] for n, m in MAPS.items()},
                             lambda: {n: m[1] for n, m in MAPS.items()},
                             lambda: dict(KNOWN_ENTRIES), lambda: {"tls_calls": 7}),
        "cgroup": CgroupCollector(proc_root=str(cg / "proc"), cgroup_root=str(cg / "sys" / "fs" / "cgroup")),
        "config": ReloadCollector(ReloadState(last_ok=True, last_success=1764460800.0,
                                              successes=3, failures=1)),
        "build": BuildInfoCollector(rev=lambda: REVISION),
        "targets": TargetsCollector(SimpleNamespace(gone_total={"pid": 2, "cgroup": 1}, current=SimpleNamespace(
            matched={"namespace=shop,pod=checkout-*": [41, 42], "label app=cart": []})), lambda: 1),
        "kubernetes": KubernetesCollector(
            SimpleNamespace(kubelet=SimpleNamespace(results={"ok": 40, "timeout": 2, "http": 1}, pods={"u": 1},
                                                    last_success=1764460800.0, skipped=2),
                            cgroups={41: 1, 42: 2, 43: 3}, pods_gone=lambda uids: set()),
            lambda: SimpleNamespace(forget_pods=lambda gone: 0,
                                    snapshot=lambda: ({("shop", "checkout-1", "api"): [3, 900, 1200, 6, 4, 1, 0],
                                                       ("", "other", ""): [1, 10, 20, 1, 1, 0, 0]}, 1, 0)),
            lambda: 0),
        "tls": TlsFilesCollector(lambda: {"files": 3, "refused": {"user_limit": 12, "not_mapped": 1}}),
    }


class FakeHttpServer:
    rejected = {"header_timeout": 12, "overload": 1, "http09": 2, "too_large": 0}


HTTP_SERVER = FakeHttpServer()          # the collector holds its servers weakly


def render(colls) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Guarded(colls))
    reg.register(HttpCollector([HTTP_SERVER]))     # serve() registers it beside the app's
    text = generate_latest(reg).decode()
    return re.sub(rf"^({DURATION}\{{[^}}]*\}}) \S+$", rf"\1 {TOKEN}", text, flags=re.M)


# ---- the golden ------------------------------------------------------------

def test_golden(fixture_kernel):
    text = render(fixture_collectors())
    if os.environ.get("NETTAP_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_render_is_stable(fixture_kernel):
    """Two scrapes of the same state give the same text (caches do not leak)."""
    colls = fixture_collectors()
    assert render(colls) == render(colls)


def _doc_contract():
    """{metric name: (type, [labels])} from the tables of docs/metrics.md, but for the Ingest
    section's: `nettap ingest` is another process, with its own /metrics."""
    out = {}
    section = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if section == "Ingest":
            continue
        m = re.match(r"\|\s*`(nettap_[a-z_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            labels = [l.strip() for l in m.group(3).split(",") if l.strip()]
            out[m.group(1)] = (m.group(2), labels)
    return out


def _golden_families():
    text = GOLDEN.read_text().replace(TOKEN, "0")
    return list(text_string_to_metric_families(text))


def test_golden_matches_docs():
    """Every nettap_ family of the golden is in docs/metrics.md with that type
    and those labels (exposition names of counters carry _total)."""
    doc = _doc_contract()
    assert len(doc) > 30, "the docs table did not parse"
    seen = set()
    for fam in _golden_families():
        if not fam.name.startswith("nettap_"):
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        seen.add(name)
        assert name in doc, f"{name} is exposed but not in docs/metrics.md"
        dtype, dlabels = doc[name]
        assert fam.type == dtype, f"{name}: exposed as {fam.type}, documented as {dtype}"
        for s in fam.samples:
            labels = [k for k in s.labels if not (fam.type == "histogram" and k == "le")]   # a bucket's bound
            assert sorted(labels) == sorted(dlabels), f"{name}: labels {sorted(labels)} != documented {dlabels}"
    # and the fixture covers the whole contract
    assert set(doc) - seen == set(), f"documented but not in the golden: {set(doc) - seen}"


def test_golden_label_values_match_docs():
    fams = {f.name: f for f in _golden_families()}
    probes = {s.labels["probe"] for s in fams["nettap_probe_calls"].samples}
    rings = {s.labels["ring"] for s in fams["nettap_ringbuf_drops"].samples}
    stages = {s.labels["stage"] for s in fams["nettap_records_lost"].samples}
    assert probes == {"tcp_sendmsg", "tcp_recvmsg"}
    assert rings == {"capture_chunks", "capture_eof", "logs"}
    assert stages == {"queue", "sink", "decode"}
    mech = {s.labels["mechanism"] for s in fams["nettap_probe_attached"].samples}
    assert mech <= {"fentry", "kprobe", "tracepoint", "tp_btf", "none", "unsupported"}
    assert {s.labels["direction"] for s in fams["nettap_tcp_resets"].samples} == {"sent", "received"}
    assert {s.labels["errno"] for s in fams["nettap_tcp_socket_errors"].samples} == {"ECONNREFUSED", "ECONNRESET",
                                                                                  "other"}
    assert {(s.labels["from"], s.labels["to"]) for s in fams["nettap_tcp_state_changes"].samples} == {
        ("CLOSE", "SYN_SENT"), ("SYN_SENT", "ESTABLISHED"), ("LISTEN", "SYN_RECV"), ("SYN_RECV", "ESTABLISHED"),
        ("ESTABLISHED", "CLOSE")}
    src = {s.labels["source"] for s in fams["nettap_bpf_stats_source"].samples}
    assert src <= {"fd", "sysctl", "external"}
    results = {s.labels["result"] for s in fams["nettap_config_reloads"].samples}
    assert results == {"success", "failure"}
    reasons = {s.labels["reason"] for s in fams["nettap_http_connections_rejected"].samples}
    assert reasons == {"header_timeout", "write_timeout", "overload", "http09", "too_large", "unauthorized",
                       "auth_throttled", "client_gone"}


def test_golden_node_aggregation():
    fams = {f.name: f for f in _golden_families()}
    runs = {(s.labels["program"], s.labels["type"], s.labels["owner"]): s.value
            for s in fams["nettap_node_bpf_program_runs"].samples if s.name.endswith("_total")}
    assert runs[("sd_devices", "cgroup_device", "systemd")] == 12
    assert runs[("id30", "socket_filter", "none")] == 9
    count = {(s.labels["type"], s.labels["owner"]): s.value for s in fams["nettap_node_bpf_programs"].samples}
    assert count == {("tracing", "nettap"): 2, ("cgroup_device", "systemd"): 2,
                     ("cgroup_skb", "systemd"): 1, ("socket_filter", "none"): 1}


def test_promtool_accepts_golden():
    text = GOLDEN.read_text().replace(TOKEN, "0.000123")
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "" and p.stderr.strip() == "", p.stdout + p.stderr


# ---- Guarded ----------------------------------------------------------------

class Boom:
    def describe(self):
        return []

    def collect(self):
        raise RuntimeError("boom")


class BoomMidway:
    """Raises after yielding one family: Guarded must not keep the half."""

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        yield GaugeMetricFamily("nettap_half_written", "x", value=1)
        raise RuntimeError("boom midway")


def _samples(reg):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in reg.collect() for s in f.samples}


def test_guarded_failure_is_isolated(fixture_kernel, caplog):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Guarded({"probes": ProbeCollector(lambda: COUNTERS, lambda: DROPS),
                          "maps": Boom(), "half": BoomMidway(),
                          "config": ReloadCollector(ReloadState())}))
    s = _samples(reg)
    ok = {k[1][0][1]: v for k, v in s.items() if k[0] == "nettap_scrape_collector_success"}
    assert ok == {"probes": 1, "maps": 0, "half": 0, "config": 1}
    dur = {k[1][0][1] for k in s if k[0] == DURATION}
    assert dur == {"probes", "maps", "half", "config"}
    names = {k[0] for k in s}
    assert not any(n.startswith("nettap_bpf_map_") for n in names)
    assert "nettap_half_written" not in names
    assert ("nettap_probe_calls_total", (("probe", "tcp_sendmsg"),)) in s
    assert "nettap_config_reloads_total" in names
    assert "collector maps failed: boom" in caplog.text
    # and the exposition of the survivors is still valid
    generate_latest(reg)


def test_guarded_describe_reads_nothing():
    """Registering (describe) must not call the readers."""
    def fail():
        raise AssertionError("read at describe time")
    reg = CollectorRegistry(auto_describe=True)
    reg.register(Guarded({"probes": ProbeCollector(fail, fail),
                          "maps": MapCollector(fail, fail, fail)}))


# ---- MapCollector's real memlock read --------------------------------------

def test_map_memlock_of_a_plain_fd(tmp_path):
    """Against an ordinary file fd the fdinfo has no memlock: 0. Static map
    types are cached per fd, growing ones (HASH, TASK_STORAGE) re-read."""
    f = tmp_path / "x"
    f.write_text("")
    fd = os.open(f, os.O_RDONLY)
    try:
        mc = MapCollector(lambda: {}, lambda: {}, lambda: {})
        assert mc._memlock(fd, 2) == 0
        assert mc._static_mem == {fd: 0}
        os.close(fd)          # cached: the (now closed) fd is not read again
        assert mc._memlock(fd, 2) == 0
        fd = os.open(f, os.O_RDONLY)
        mc2 = MapCollector(lambda: {}, lambda: {}, lambda: {})
        assert mc2._memlock(fd, 1) == 0
        assert mc2._static_mem == {}
    finally:
        os.close(fd)


def test_map_entries_rules(monkeypatch):
    monkeypatch.setattr(MapCollector, "_memlock", lambda self, fd, mtype: 0)
    mc = MapCollector(lambda: {n: m[0] for n, m in MAPS.items()},
                      lambda: {n: m[1] for n, m in MAPS.items()}, lambda: dict(KNOWN_ENTRIES))
    fams = {f.name: f for f in mc.collect()}
    entries = {s.labels["map"]: s.value for s in fams["nettap_bpf_map_entries"].samples}
    assert entries == {"capture_config": 1, "capture_conns": 7, "capture_pids": 1, "probe_counters": 2}
    cap = {s.labels["map"]: s.value for s in fams["nettap_bpf_map_max_entries"].samples}
    assert cap["capture_chunks"] == 16 << 20


def test_every_named_row_fits_its_block_of_obs_counters():
    """The lifecycle collector reads obs_counters by bpf/tcp.h's generated
    blocks (NETTAP_OBS_*) and names (NETTAP_RETRANS_*, _TIMER_*, _WAKEUP_*):
    the blocks tile the table, and each value named lands in its own block."""
    blocks = sorted(tcp_h.OBS_BLOCKS.values())
    assert blocks[0][0] == 0 and blocks[-1][1] == tcp_h.OBS_ROWS
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    need = {"states": 16 * 16, "resets": max(tcp_h.NAMES["DIR"]) + 1, "errors": 256,
            "retrans": max(tcp_h.NAMES["RETRANS"]) + 1, "timers": (max(tcp_h.NAMES["TIMER"]) + 1) * 16,
            "wakeups": max(tcp_h.NAMES["WAKEUP"]) + 1}
    for name, rows in need.items():
        first, end = tcp_h.OBS_BLOCKS[name]
        assert end - first >= rows, name
