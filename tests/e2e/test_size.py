"""End-to-end: `nettap size` against a real Prometheus scraping two real
nettaps (one busy with bpfStats on, in a cgroup with a CPU quota and a memory
limit; one idle with bpfStats off); every printed figure is checked against
what Prometheus holds, read the other way (raw samples, query_range)."""
import math
import re
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np
import pytest
import requests
import yaml

from e2e.test_mixin_e2e import limited_cgroups  # noqa: F401 (the fixture)
from procs import ROOT, Nettap, Prometheus
from traffic import Server, send_messages

pytestmark = pytest.mark.e2e
MiB = 1 << 20
RANGE, WINDOW = 20, 5      # s: enough samples for p50-p99 at 1 s steps, and a window of 5 scrapes


def size(prom, *extra):
    r = subprocess.run([str(ROOT / "scripts/run.sh"), "size", "--prometheus", prom.url, "--range", f"{RANGE}s",
                        "--window", f"{WINDOW}s", "--step", "1s", *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def raw(prom, expr, at):
    """Sample values of a range selector at time at."""
    r = requests.get(prom.url + "/api/v1/query", params={"query": expr, "time": at}, timeout=10).json()
    return [float(v) for s in r["data"]["result"] for _, v in s["values"]]


def rates(prom, expr, at):
    """The rate at each second of the range, by query_range (the subquery's steps: every
    second in [at - range, at], Prometheus 2's closed range)."""
    r = requests.get(prom.url + "/api/v1/query_range", params={"query": expr, "start": at - RANGE, "end": at,
                                                               "step": 1}, timeout=10).json()
    return np.array([float(v) for s in r["data"]["result"] for _, v in s["values"]])


def block(out, instance):
    m = re.search(rf"^node {re.escape(instance)}\n(.*?)\n\n", out, re.S | re.M)
    assert m, out
    return m.group(1)


def figure(text, label):
    return float(re.search(rf"{label} ([\d.]+)m", text).group(1)) / 1000


def test_size_figures_are_what_prometheus_holds(tmp_path, limited_cgroups):  # noqa: F811
    srv = Server()
    (tmp_path / "busy").mkdir()
    (tmp_path / "idle").mkdir()
    busy = Nettap(tmp_path / "busy", {"captures": [{"port": srv.port}], "diagnostics": {"bpfStats": {"enabled": True}}},
                  cgroups=limited_cgroups)
    idle = Nettap(tmp_path / "idle", {"captures": [{"port": 1}], "diagnostics": {"bpfStats": {"enabled": False}}})
    prom = Prometheus(tmp_path, {"nettap": f"127.0.0.1:{busy.port}", "nettap-idle": f"127.0.0.1:{idle.port}"})
    try:
        end = time.time() + RANGE + 5
        while time.time() < end:
            send_messages(srv.port, 50, 300)
            time.sleep(0.1)
        out = size(prom)
        when = re.search(r" to (\S+Z) ", out).group(1)
        at = datetime.strptime(when, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
        checked = {}
        for n in (busy, idle):
            inst = f"127.0.0.1:{n.port}"
            b = block(out, inst)
            sel = f'{{instance="{inst}"}}'
            # Memory: the peak of the raw samples, to the byte.
            rss = max(raw(prom, f"process_resident_memory_bytes{sel}[{RANGE}s]", at))
            cg = max(raw(prom, f"nettap_cgroup_memory_usage_bytes{sel}[{RANGE}s]", at))
            assert f"peak RSS {rss:,.0f} B" in b and f"peak cgroup usage {cg:,.0f} B" in b, b
            req = math.ceil(max(rss, cg) * 1.25 / (16 * MiB)) * 16
            assert f"memory  request {req}Mi  limit {2 * req}Mi" in b, b
            # CPU: percentiles of the rate at every second of the range.
            cpu = rates(prom, f"sum(rate(process_cpu_seconds_total{sel}[{WINDOW}s]))", at)
            assert len(cpu) == RANGE + 1
            for label, want in (("p50", np.percentile(cpu, 50)), ("p95", np.percentile(cpu, 95)),
                                ("p99", np.percentile(cpu, 99)), ("max", cpu.max())):
                assert figure(b, label) == pytest.approx(want, abs=6e-6), (label, b)
            # 1e-9, as nettap size rounds: a p95 exactly on a step (10 m) stays there despite float noise
            creq = max(math.ceil(np.percentile(cpu, 95) * 1000 / 5 - 1e-9) * 5, 10)
            assert re.search(rf"cpu     request {creq}m  limit \d+m", b), b
            checked[inst] = (np.percentile(cpu, 95), req, creq)
        # The busy nettap: a CFS quota (periods counted), kernel BPF time measured.
        b = block(out, f"127.0.0.1:{busy.port}")
        periods = raw(prom, f'nettap_cgroup_cpu_periods_total{{instance="127.0.0.1:{busy.port}"}}[{RANGE}s]', at)
        assert re.search(r"throttled in [\d,]+ of [1-9][\d,]* CFS periods", b), b
        assert periods[-1] > periods[0]
        bpf = rates(prom, f'sum(rate(nettap_bpf_program_run_time_seconds_total{{instance="127.0.0.1:{busy.port}"}}'
                          f'[{WINDOW}s]))', at)
        kernel = b[b.index("  kernel"):]
        assert figure(kernel, "p95") == pytest.approx(np.percentile(bpf, 95), abs=6e-6) and bpf.max() > 0
        assert figure(kernel, "max") == pytest.approx(bpf.max(), abs=6e-6)
        assert "bpfStats on for 100 % of the range" in kernel
        # The idle one: not measured, and how to measure it.
        b = block(out, f"127.0.0.1:{idle.port}")
        assert "not measured (bpfStats was off" in b and "diagnostics.bpfStats.enabled: true" in b
        # The busiest node, and the DaemonSet's one spec.
        top = max(checked, key=lambda i: checked[i][0])
        assert f"busiest node: {top} (highest p95 user CPU)" in out
        ds = re.search(r"DaemonSet .*: requests cpu (\d+)m memory (\d+)Mi; limits cpu (\d+)m memory (\d+)Mi", out)
        assert int(ds.group(2)) == max(v[1] for v in checked.values())
        assert int(ds.group(1)) == max(v[2] for v in checked.values())

        # -o yaml: a strategic-merge patch that kubectl applies to deploy/kubernetes/daemonset.yaml.
        patch = tmp_path / "patch.yaml"
        patch.write_text(size(prom, "-o", "yaml", "--at", when))     # the same evaluation time
        r = subprocess.run(["kubectl", "patch", "--local", "-f", str(ROOT / "deploy/kubernetes/daemonset.yaml"),
                            "--type", "strategic", "--patch-file", str(patch), "-o", "yaml"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        c = {x["name"]: x for x in yaml.safe_load(r.stdout)["spec"]["template"]["spec"]["containers"]}
        assert set(c) == {"nettap", "nettap-ingest"}                                  # merged by name
        assert c["nettap"]["securityContext"]["capabilities"]["add"]                  # merged, not replaced
        before = {x["name"]: x for x in yaml.safe_load((ROOT / "deploy/kubernetes/daemonset.yaml").read_text())
                  ["spec"]["template"]["spec"]["containers"]}
        assert c["nettap-ingest"] == before["nettap-ingest"]                         # the capture's sizes only
        res = c["nettap"]["resources"]
        assert res["requests"]["memory"] == f"{ds.group(2)}Mi" and res["limits"]["memory"] == f"{ds.group(4)}Mi"
        assert res["requests"]["cpu"] == f"{ds.group(1)}m" and res["limits"]["cpu"] == f"{ds.group(3)}m"
    finally:
        prom.stop()
        idle.stop()
        busy.stop()


def test_size_says_when_prometheus_has_no_nettap(tmp_path):
    prom = Prometheus(tmp_path, {})
    try:
        r = subprocess.run([sys.executable, "-m", "exporter", "size", "--prometheus", prom.url, "--range", "1m"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith("nettap size: no nettap series (nettap_build_info{})") and r.stderr.count("\n") == 1
    finally:
        prom.stop()
