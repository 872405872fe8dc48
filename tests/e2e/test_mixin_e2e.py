"""End-to-end for the mixin: a real Prometheus with the rendered rules
scrapes the real exporter under traffic; every dashboard query is evaluated
through its HTTP API; forced ring drops fire the drops alert, which reaches
a real Alertmanager and its webhook (a small server in this test)."""
import errno
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import _jsonnet
import pytest
import yaml

from natscluster import NatsCluster
from procs import ROOT, Alertmanager, Ingest, Nettap, Prometheus, wait_for
from traffic import ClientProcess, Server, send_messages
from unit.test_mixin import dashboard_queries

pytestmark = pytest.mark.e2e
RULES = [ROOT / "mixin/rendered/nettap-alerts.yaml", ROOT / "mixin/rendered/nettap-rules.yaml"]
# Series other exporters provide (cAdvisor, kube-state-metrics, node_exporter): absent here.
FOREIGN = re.compile(r"\b(container_\w+|kube_\w+|node_\w+)\b")


@pytest.fixture
def limited_cgroups():
    """v1 cpu and memory cgroups with a CFS quota and a memory limit, so the
    throttling and memory-limit panels have series (this machine's root
    cgroups have neither)."""
    made = []
    for ctl, files in (("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "150000"}),
                       ("memory", {"memory.limit_in_bytes": str(1 << 30)})):
        d = f"/sys/fs/cgroup/{ctl}/nettap-e2e-{os.getpid()}"
        os.makedirs(d, exist_ok=True)
        for name, value in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(value)
        made.append(d)
    yield made
    for d in made:
        for _ in range(50):
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.1)


def test_every_dashboard_query_evaluates_and_nettaps_own_return_data(tmp_path, limited_cgroups):
    srv = Server()
    closed = socket.create_server(("127.0.0.1", 0))
    refused = closed.getsockname()[1]
    closed.close()                                # a captured port nothing listens on: resets, errors
    nats = NatsCluster(tmp_path / "nats", n=1).start()     # nettap ingest's engine: the Ingest row
    cfg = {"captures": [{"port": srv.port}, {"port": refused}],
           "output": {"type": "jsonl", "path": str(tmp_path / "capture.jsonl"), "root": str(tmp_path)},
           "diagnostics": {"bpfStats": {"enabled": True, "scope": "node"}},
           "ingest": {"servers": nats.urls, "stream": {"storage": "memory"}}}
    n = Nettap(tmp_path, cfg, cgroups=limited_cgroups)
    ing = Ingest(tmp_path, cfg)
    prom = Prometheus(tmp_path, {"nettap": f"127.0.0.1:{n.port}", "nettap-ingest": f"127.0.0.1:{ing.port}"},
                      rule_files=RULES)
    try:
        end = time.time() + 12                    # traffic across several scrapes
        while time.time() < end:
            send_messages(srv.port, 20, 300)
            with socket.socket() as c:
                assert c.connect_ex(("127.0.0.1", refused)) == errno.ECONNREFUSED
            time.sleep(0.5)
        time.sleep(2)
        queries = dashboard_queries(include_variables=True)
        assert len(queries) > 40
        shows = {}                                # panel -> does any of its queries return data
        for uid, title, expr in queries:
            result = prom.query(expr)             # raises on any query error
            if not FOREIGN.search(expr):
                shows[(uid, title)] = shows.get((uid, title), False) or bool(result)
        # A panel over nettap's own metrics shows data (a panel with two queries may have
        # one empty: OOM events exist on cgroup v2 only, this machine's controllers are v1).
        blank = [p for p, ok in shows.items() if not ok]
        assert blank == [], f"panels over nettap's own metrics show nothing: {blank}"
        # The rules loaded and evaluate without error.
        groups = __import__("requests").get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert {r["health"] for g in groups for r in g["rules"]} == {"ok"}
    finally:
        prom.stop()
        ing.stop()
        n.stop()
        nats.close()


class Webhook:
    """Alertmanager's webhook receiver: records every alert it is sent."""

    def __init__(self):
        self.alerts = []
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.alerts.extend(json.loads(body)["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass
        self.srv = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()


def test_drops_alert_fires_and_reaches_alertmanager(tmp_path):
    # The mixin's alerts, rendered with test timing: no `for`, 20 s windows.
    rendered = _jsonnet.evaluate_snippet("test", """
        local m = (import 'mixin/mixin.libsonnet') + { _config+:: { ringBufferDropsFor: '0s', rateInterval: '20s' } };
        m.prometheusAlerts""", jpathdir=[str(ROOT)])
    rules = tmp_path / "alerts.yaml"
    rules.write_text(yaml.safe_dump(json.loads(rendered)))
    hook = Webhook()
    am = Alertmanager(tmp_path, hook.url)
    srv = Server()
    n = Nettap(tmp_path, {"captures": [], "rings": {"capture_chunks": 4096}})   # 8 chunk slots
    prom = Prometheus(tmp_path, {"nettap": f"127.0.0.1:{n.port}"}, rule_files=[rules], alertmanager=am.addr)
    try:
        cl = ClientProcess(srv.port, 20000, 100)
        n.write_config({"captures": [{"pid": cl.pid}], "rings": {"capture_chunks": 4096}})
        wait_for(lambda: n.sample("nettap_config_reloads_total", result="success") == 2, what="captures applied")
        cl.go()
        srv.wait_received(1)
        assert n.sample("nettap_ringbuf_drops_total", ring="capture_chunks") > 0
        firing_query = 'ALERTS{alertname="NettapRingBufferDrops",alertstate="firing"}'
        firing = wait_for(lambda: [a for a in prom.query(firing_query) if a["metric"]["ring"] == "capture_chunks"],
                          timeout=30, what="alert firing")
        assert firing[0]["metric"]["severity"] == "critical"
        got = wait_for(lambda: [a for a in hook.alerts if a["labels"]["alertname"] == "NettapRingBufferDrops"],
                       timeout=30, what="alert at the webhook")
        a = got[0]
        assert a["status"] == "firing" and a["labels"]["ring"] == "capture_chunks"
        assert a["labels"]["severity"] == "critical"
        assert a["annotations"]["summary"].endswith(".")
        assert "capture_chunks" in a["annotations"]["description"]
        assert a["annotations"]["runbook_url"].endswith("#nettapringbufferdrops")
    finally:
        prom.stop()
        n.stop()
        am.stop()
