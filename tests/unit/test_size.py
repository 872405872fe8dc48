"""`nettap size`'s rules and output from fixed figures (the figures' queries
are checked against a real Prometheus in tests/e2e/test_size.py)."""
import pytest
import yaml

from exporter.commands import size
from exporter.commands.size import MiB, Node


def node(**kw):
    base = dict(instance="a:42424", rss_peak=60 * MiB, cgroup_peak=45 * MiB, oom_kills=0,
                cpu={"p50": 0.003, "p95": 0.0121, "p99": 0.02, "max": 0.04},
                periods=1000, throttled_periods=0, throttled_seconds=0, drops=0, calls=5e6,
                bpf={"p50": 0.01, "p95": 0.02, "max": 0.05}, bpf_coverage=1.0)
    base.update(kw)
    return Node(**base)


def test_memory_from_the_larger_peak_plus_a_quarter_rounded_to_16_mib():
    assert node().mem_request() == 80 * MiB                  # 60 MiB * 1.25 = 75 -> 80
    assert node(rss_peak=64 * MiB).mem_request() == 80 * MiB   # exactly 80: stays
    assert node(cgroup_peak=100 * MiB).mem_request() == 128 * MiB
    assert node().mem_limit_suggested() == 160 * MiB
    # OOM kills: the peak was held down by the limit, so the limit counts as the peak.
    assert node(oom_kills=2, mem_limit=128 * MiB).mem_request() == 160 * MiB
    assert node(rss_peak=None, cgroup_peak=None).mem_request() is None


def test_cpu_request_from_p95_limit_from_the_peak_doubled_or_quadrupled_when_throttled():
    assert node().cpu_request() == 15                         # 12.1m -> 15m
    assert node(cpu={"p95": 0.001, "max": 0.002}).cpu_request() == 10     # at least 10m
    assert node().cpu_limit() == 100                          # 2 x 40m = 80 -> at least 100m
    assert node(cpu={"p95": 0.1, "max": 0.3}).cpu_limit() == 600
    throttled = node(cpu={"p95": 0.1, "max": 0.3}, throttled_periods=50)    # 5 % of periods
    assert throttled.throttled_ratio() == 0.05 and throttled.cpu_limit() == 1200
    assert node(cpu={"p95": 0.1, "max": 0.3}, throttled_periods=10).cpu_limit() == 600   # 1 %: not above
    assert node(cpu={}).cpu_request() is None and node(cpu={}).cpu_limit() is None


def test_text_gives_the_figures_rules_and_busiest_node():
    a = node()
    b = node(instance="b:42424", cpu={"p50": 0.05, "p95": 0.2, "p99": 0.3, "max": 0.35}, rss_peak=50 * MiB,
             bpf={}, bpf_coverage=0, periods=0, throttled_periods=0)
    out = size.text([a, b], "http://prom:9090", 1796137200, "7d", "5m", "1m")
    assert out.startswith("nettap size: 2 node(s), the 7d to 2026-12-01T15:00:00Z (rate window 5m, step 1m), "
                          "from http://prom:9090\n")
    blk = out.split("node a:42424\n")[1].split("\n\n")[0]
    assert "memory  request 80Mi  limit 160Mi" in blk and "peak RSS 62,914,560 B (60.0 MiB)" in blk
    assert "p50 3.00m  p95 12.10m  p99 20.00m  max 40.00m" in blk
    assert "throttled in 0 of 1,000 CFS periods (0.00 %)" in blk
    assert f"\nmemory rule: {size.MEM_RULE}\ncpu rule: {size.CPU_RULE}\n" in out
    assert "p50 10.00m  p95 20.00m  max 50.00m" in blk and "bpfStats on for 100 % of the range" in blk
    blk = out.split("node b:42424\n")[1].split("\n\n")[0]
    assert "no CPU limit on nettap's cgroup" in blk
    assert "not measured (bpfStats was off over the range)" in blk and "diagnostics.bpfStats.enabled: true" in blk
    assert ("busiest node: b:42424 (highest p95 user CPU): requests cpu 200m memory 64Mi; "
            "limits cpu 700m memory 128Mi") in out
    assert ("DaemonSet (one spec for every node: the largest per-node figure): requests cpu 200m memory 80Mi; "
            "limits cpu 700m memory 160Mi") in out


def test_yaml_patch_merges_by_container_name():
    out = size.yaml_patch([node(), node(instance="b", rss_peak=200 * MiB)], "http://p", 0, "7d")
    assert out.startswith("# nettap size: 2 node(s), the 7d to 1970-01-01T00:00:00Z")
    c = yaml.safe_load(out)["spec"]["template"]["spec"]["containers"]
    assert c == [{"name": "nettap", "resources": {"requests": {"cpu": "15m", "memory": "256Mi"},
                                                   "limits": {"cpu": "100m", "memory": "512Mi"}}}]
    with pytest.raises(size.SizeError, match="cpu_request"):
        size.yaml_patch([node(cpu={})], "http://p", 0, "7d")


def ingest_node(**kw):
    base = dict(instance="a:42425", rss_peak=36 * MiB, cgroup_peak=30 * MiB, oom_kills=0,
                cpu={"p50": 0.002, "p95": 0.004, "p99": 0.01, "max": 0.08},
                periods=500, throttled_periods=0, throttled_seconds=0, role=size.INGEST)
    base.update(kw)
    return Node(**base)


def test_the_ingest_is_sized_apart_from_its_own_figures():
    """nettap ingest's targets get their own blocks and container line, without the capture's
    kernel, ring and probe figures, and never count as the capture's nodes."""
    out = size.text([node(), ingest_node()], "http://prom:9090", 1796137200, "7d", "5m", "1m")
    assert out.startswith("nettap size: 1 node(s) and 1 nettap ingest(s), the 7d to 2026-12-01T15:00:00Z")
    assert "busiest node: a:42424" in out
    blk = out.split("nettap ingest a:42425\n")[1].split("\n\n")[0]
    assert "memory  request 48Mi  limit 96Mi" in blk                     # 36 MiB x 1.25 -> 48
    assert "cpu     request 10m  limit 200m" in blk                      # p95 4m -> at least 10m
    assert "throttled in 0 of 500 CFS periods (0.00 %), 0.000 s" in blk
    assert "ring drops" not in blk and "kernel" not in blk and "bpfStats" not in blk
    assert ("DaemonSet's nettap-ingest container (the largest per-node figure): requests cpu 10m memory 48Mi; "
            "limits cpu 200m memory 96Mi") in out
    assert ("DaemonSet (one spec for every node: the largest per-node figure): requests cpu 15m memory 80Mi; "
            "limits cpu 100m memory 160Mi") in out


def test_patch_and_helm_values_size_each_container_from_its_own_series():
    nodes = [node(), node(instance="b", rss_peak=200 * MiB), ingest_node(), ingest_node(instance="b:42425",
                                                                                       rss_peak=50 * MiB)]
    capture = {"requests": {"cpu": "15m", "memory": "256Mi"}, "limits": {"cpu": "100m", "memory": "512Mi"}}
    ingest = {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}}
    c = yaml.safe_load(size.yaml_patch(nodes, "http://p", 0, "7d"))["spec"]["template"]["spec"]["containers"]
    assert c == [{"name": "nettap", "resources": capture}, {"name": "nettap-ingest", "resources": ingest}]
    out = size.helm_values(nodes, "http://p", 0, "7d")
    assert out.startswith("# nettap size: 2 node(s) and 2 nettap ingest(s), the 7d to 1970-01-01T00:00:00Z")
    assert "helm upgrade nettap deploy/helm/nettap --reuse-values -f THIS_FILE" in out
    assert yaml.safe_load(out) == {"capture": {"resources": capture}, "ingest": {"resources": ingest}}
    # No ingest series: the capture's values alone, and the comment says why.
    out = size.helm_values(nodes[:2], "http://p", 0, "7d")
    assert yaml.safe_load(out) == {"capture": {"resources": capture}}
    assert "# No nettap ingest series (nettap_ingest_connected) over the range" in out
    with pytest.raises(size.SizeError, match="not enough data for the values: the ingest's cpu_request"):
        size.helm_values([node(), ingest_node(cpu={})], "http://p", 0, "7d")


def test_main_asks_each_role_its_own_queries(capsys):
    """Through Prometheus's API: the ingest's figures are asked of the ingest's targets only, and
    none of the capture's own (BPF time, ring drops, probe calls); -o helm prints both."""
    figures = {"process_resident_memory_bytes": str(40 * MiB), "process_cpu_seconds_total": "0.02"}
    prom = _PromLike(lambda q: next((v for k, v in figures.items() if k in q), "0"), ingest=True)
    try:
        rc = size.main(["--prometheus", prom.url, "--at", "1796137200", "-o", "helm"])
    finally:
        prom.close()
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"cpu": "100m", "memory": "128Mi"}}
    assert yaml.safe_load(out) == {"capture": {"resources": res}, "ingest": {"resources": res}}
    ingest_group = "(group by (instance) (last_over_time(nettap_ingest_connected"
    asked = [q for q in prom.queries if ingest_group in q and not q.startswith("group by")]
    theirs = [q for q in asked if "unless on (instance)" not in q]
    assert theirs and not [q for q in theirs if "nettap_bpf_program" in q or "nettap_ringbuf" in q
                           or "nettap_probe" in q]
    assert any("nettap_bpf_program_run_time_seconds_total" in q and "unless on (instance)" in q for q in prom.queries)


def test_at_accepts_unix_seconds_and_utc():
    assert size._args(["--prometheus", "u", "--at", "2026-12-01T15:00:00Z"]).at == 1796137200
    assert size._args(["--prometheus", "u", "--at", "12.5"]).at == 12.5
    with pytest.raises(SystemExit):
        size._args(["--prometheus", "u", "--at", "yesterday"])


class _PromLike:
    """A real HTTP server answering /api/v1/query as Prometheus does: the
    capture's targets (a:42424) for the nettap_build_info group, the ingest's
    (a:42425, when given) for the nettap_ingest_connected group, and for every
    other query ``value`` (a str, or a function of the query), for the target
    whose group the query is kept to. ``queries`` lists what was asked."""

    def __init__(self, value, ingest: bool = False):
        import http.server
        import json
        import threading
        from urllib.parse import parse_qs, urlparse
        answer = value if callable(value) else (lambda q: value)
        self.queries = queries = []

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                q = parse_qs(urlparse(self.path).query)["query"][0]
                queries.append(q)
                if q.startswith("group by (instance) (last_over_time(nettap_build_info"):
                    result = [("a:42424", "1")]
                elif q.startswith("group by (instance) (last_over_time(nettap_ingest_connected"):
                    result = [("a:42425", "1")] if ingest else []
                elif "and on (instance) (group by (instance) (last_over_time(nettap_ingest_connected" in q:
                    result = [("a:42425", answer(q))]
                else:
                    result = [("a:42424", answer(q))]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {"instance": i}, "value": [0, v]} for i, v in result]}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
@pytest.mark.parametrize("output", ["text", "yaml"])
def test_a_nan_or_inf_answer_is_no_figure_said_once_never_a_traceback(value, output, capsys):
    """Prometheus answers "NaN" for 0/0 (and +Inf for x/0): such a figure is
    not known, said on stderr with how many, never a traceback (issue 45)."""
    prom = _PromLike(value)
    try:
        rc = size.main(["--prometheus", prom.url, "--at", "1796137200", "-o", output])
    finally:
        prom.close()
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert (f"nettap size: Prometheus answered {value} for " in err and "taken as not known" in err
            and "(a:42424 " in err), err
    if output == "text":
        assert rc == 0 and "node a:42424" in out and "memory  request -" in out
    else:
        assert rc == 1 and "not enough data for a patch" in err
