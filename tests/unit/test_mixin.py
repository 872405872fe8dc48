"""The monitoring mixin: rendered files are fresh, promtool accepts and tests the rules, and
alerts and dashboards follow the monitoring-mixin conventions.

Needs the `jsonnet` and `PyYAML` packages and promtool (Debian `prometheus`); no privileges.
`dashboard_queries()` is also the end-to-end tests' list of every dashboard query.
"""

import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _jsonnet
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MIXIN = REPO / "mixin"
RENDERED = MIXIN / "rendered"
DASHBOARDS = RENDERED / "dashboards"
RUNBOOK = REPO / "docs" / "runbook.md"
RENDERED_RULES = [RENDERED / "nettap-alerts.yaml", RENDERED / "nettap-rules.yaml"]
DASHBOARD_FILES = ["nettap-overview.json", "nettap-bpf-programs.json", "nettap-sizing.json"]

SEVERITIES = {"critical", "warning", "info"}
MAX_GROUP_RULES = 20   # big groups evaluate slowly and read badly; split by concern instead
# Values that may stand for Grafana's template variables in end-to-end queries.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "1m"}


@functools.lru_cache(maxsize=None)
def _config():
    """The mixin's _config, with its defaults."""
    return json.loads(_jsonnet.evaluate_snippet(
        str(MIXIN / "config"), "(import 'mixin.libsonnet')._config"))


def _load_render():
    spec = importlib.util.spec_from_file_location("nettap_mixin_render", MIXIN / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _promtool():
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package"
    return path


def _rules(path):
    return [(g["name"], r) for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def _alerts():
    return [r for _, r in _rules(RENDERED / "nettap-alerts.yaml")]


def _dashboards():
    return {name: json.loads((DASHBOARDS / name).read_text()) for name in DASHBOARD_FILES}


def _panels(dashboard):
    """Every panel, including those nested in collapsed rows."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def _github_anchor(heading):
    """GitHub's heading slug: lowercase, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _runbook_anchors():
    return {_github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.M)}


def dashboard_queries(include_variables=False):
    """[(dashboard uid, panel title, expr)] for every query of the committed dashboards, with
    Grafana's variables replaced so that plain Prometheus can evaluate it: $__rate_interval and
    $__interval by 1m, $__range by 5m, template variables ($job, ${instance}, ...) by `.*`.

    With include_variables, a template variable's `label_values(selector, label)` query adds
    (uid, "variable <name>", selector).
    """
    out = []
    for _name, dash in _dashboards().items():
        names = [v["name"] for v in dash["templating"]["list"] if v["type"] != "datasource"]

        def plain(expr, names=names):
            for var, value in sorted(GRAFANA_INTERVALS.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(var, value)
            for var in names:
                expr = re.sub(r"\$\{%s\}|\$%s\b" % (var, var), ".*", expr)
            return expr

        if include_variables:
            for v in dash["templating"]["list"]:
                if v["type"] == "query":
                    m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["query"].strip(), re.S)
                    out.append((dash["uid"], "variable " + v["name"], plain(m.group(1))))
        for panel in _panels(dash):
            for target in panel.get("targets", []):
                out.append((dash["uid"], panel["title"], plain(target["expr"])))
    return out


# --- rendered output ----------------------------------------------------------------------

def test_rendered_files_are_fresh():
    render = _load_render()
    files = render.render()
    assert set(files) == {"mixin/rendered/nettap-alerts.yaml", "mixin/rendered/nettap-rules.yaml"} | {
        "mixin/rendered/dashboards/" + n for n in DASHBOARD_FILES
    }
    assert render.stale(files) == [], "stale rendered files: run python mixin/render.py"


def test_render_check_names_the_stale_file(tmp_path, monkeypatch, capsys):
    render = _load_render()
    for rel, content in render.render().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    monkeypatch.setattr(render, "REPO", tmp_path)
    assert render.main(["--check"]) == 0

    sizing = tmp_path / "mixin" / "rendered" / "dashboards" / "nettap-sizing.json"
    sizing.write_text(sizing.read_text().replace("nettap / Sizing", "edited by hand"))
    assert render.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "mixin/rendered/dashboards/nettap-sizing.json" in err and "nettap-overview" not in err


def test_render_check_cli_passes_on_the_committed_files():
    proc = subprocess.run(
        [sys.executable, str(MIXIN / "render.py"), "--check"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr


# --- promtool -----------------------------------------------------------------------------

def test_promtool_check_rules():
    proc = subprocess.run([_promtool(), "check", "rules", *map(str, RENDERED_RULES)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_test_rules():
    proc = subprocess.run([_promtool(), "test", "rules", str(MIXIN / "tests.yaml")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load((MIXIN / "tests.yaml").read_text())["tests"]
    fired, quiet, fired_variants = set(), set(), set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            if case["exp_alerts"]:
                fired.add(case["alertname"])
                for exp in case["exp_alerts"]:
                    assert exp.get("exp_labels") and exp.get("exp_annotations"), case
                    labels = exp["exp_labels"]
                    fired_variants.add((case["alertname"], labels["severity"], labels.get("source")))
            else:
                quiet.add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"
    # Every rule, not just every name: each severity/source variant fires in some test.
    variants = {(a["alert"], a["labels"]["severity"], a["labels"].get("source")) for a in _alerts()}
    assert variants - fired_variants == set()


# --- monitoring-mixin style: alerts and rules ---------------------------------------------

@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_alert_style(alert):
    name = alert["alert"]
    assert re.fullmatch(r"Nettap[A-Z][A-Za-z0-9]*", name), "CamelCase, starting with Nettap"
    assert len(name) <= 40
    assert "for" in alert and re.fullmatch(r"[1-9][0-9]*[smhd]", alert["for"])
    assert alert["labels"]["severity"] in SEVERITIES
    ann = alert["annotations"]
    assert set(ann) == {"summary", "description", "runbook_url"}
    # mixtool lint's alert-summary-style (^[A-Z].+\.$) and alert-summary-templating, as
    # monitoring.mixins.dev's guidelines: a static sentence, a capital first, a period last.
    assert re.fullmatch(r"[A-Z].+\.", ann["summary"]), f"summary: a sentence: {ann['summary']!r}"
    assert "{{" not in ann["summary"], "summary: static"
    assert "{{" in ann["description"], "description: templated"
    assert ann["runbook_url"] == _config()["runbookURLPattern"] % name.lower()


def test_runbook_url_pattern_reaches_an_anchor_of_the_runbook():
    """runbookURLPattern names docs/runbook.md, and each alert's link lands on a heading there."""
    pattern = _config()["runbookURLPattern"]
    assert pattern.count("%s") == 1 and pattern.endswith("/docs/runbook.md#%s"), pattern
    anchors = _runbook_anchors()
    for alert in _alerts():
        url = alert["annotations"]["runbook_url"]
        assert url.split("#", 1)[1] in anchors, f"{alert['alert']}: {url} has no heading in docs/runbook.md"


def test_runbook_has_a_section_per_alert_and_no_orphans():
    anchors = _runbook_anchors()
    alerts = {a["alert"].lower() for a in _alerts()}
    assert alerts - anchors == set(), "alerts without a runbook section"
    sections = set(re.findall(r"^## (Nettap[A-Z]\w*)$", RUNBOOK.read_text(), re.M))
    orphans = {s for s in sections if s.lower() not in alerts}
    assert orphans == set(), "runbook sections for alerts that do not exist"
    for link in re.findall(r"\]\(#([^)]+)\)", RUNBOOK.read_text()):
        assert link in anchors, f"runbook links to a missing anchor #{link}"


def test_rule_groups_are_small_and_names_unique():
    for path in RENDERED_RULES:
        groups = yaml.safe_load(path.read_text())["groups"]
        assert len({g["name"] for g in groups}) == len(groups)
        for g in groups:
            assert 0 < len(g["rules"]) <= MAX_GROUP_RULES, g["name"]


def test_recording_rule_names():
    for _, rule in _rules(RENDERED / "nettap-rules.yaml"):
        level, metric, operation = rule["record"].split(":")
        assert re.fullmatch(r"[a-z_]+", level) and re.fullmatch(r"[a-z0-9_]+", operation)
        assert metric.startswith("nettap_") and not metric.endswith("_total"), rule["record"]


# --- dashboards ---------------------------------------------------------------------------

_RANGE = re.compile(r"\[([^\]]*)\]")
_RATE = re.compile(r"\b(?:rate|irate)\(\s*[A-Za-z_:][\w:]*\s*(?:\{[^}]*\})?\s*\[([^\]]*)\]")


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_style(name):
    dash = json.loads((DASHBOARDS / name).read_text())
    raw = (DASHBOARDS / name).read_text()
    assert dash["uid"] == Path(name).stem
    assert dash["title"].startswith("nettap / ")
    assert "__inputs" not in dash and "${DS_" not in raw, "no exported datasource placeholders"

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("job", "instance"):
        assert variables[var]["type"] == "query"

    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids unique"
    for panel in _panels(dash):
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        if panel["type"] == "row":
            continue
        # Grafana dashboard-linter's panel-title-description-rule (mixtool lint runs it): the
        # (i) beside the title says what the panel shows.
        assert panel["title"] and panel.get("description"), f"{name}: {panel['title']}: no description"
        if panel["type"] == "text":
            continue
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs))
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', t["expr"])  # label values may hold [..]
            for window in _RATE.findall(expr):
                assert window == "$__rate_interval", f"{panel['title']}: rate over [{window}]"
            for window in _RANGE.findall(expr):
                assert window in ("$__rate_interval", "$__range", "$__range:"), (
                    f"{panel['title']}: hard-coded range [{window}]")


def test_ingest_row_selects_the_ingest_job():
    """nettap ingest is its own scrape job on its own port (instance n1:42425 beside the
    capture's n1:42424): the Ingest row filters it by its own variable, never by the capture's
    $job and $instance, but for the capture's side of "written vs. acknowledged"."""
    dash = _dashboards()["nettap-overview.json"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["ingest_instance"]["query"] == 'label_values(nettap_build_info{job="nettap-ingest"}, instance)'
    row, exprs = None, []
    for p in dash["panels"]:
        if p["type"] == "row":
            row = p["title"]
        elif row == "Ingest (NATS JetStream)":
            exprs += [t["expr"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        if "nettap_sink_" in expr:
            assert 'job=~"$job", instance=~"$instance"' in expr and 'sink="jsonl"' in expr, expr
        else:
            assert 'job="nettap-ingest", instance=~"$ingest_instance"' in expr, expr
            assert "$job" not in expr and "$instance" not in expr, expr


def test_records_drained_names_every_kind_of_every_ring():
    """The Records drained panel (by ring and kind) tells which records each ring carries, as
    docs/metrics.md does for obs_events: every kind of exporter/capture/records.py's table."""
    from exporter.capture.records import RING_KINDS
    panel = next(p for p in _panels(_dashboards()["nettap-overview.json"]) if p["title"] == "Records drained")
    metrics_md = (REPO / "docs" / "metrics.md").read_text()
    row = next(line for line in metrics_md.splitlines() if "`nettap_ringbuf_records_drained_by_kind_total`" in line)
    for ring, kinds in RING_KINDS.items():
        assert ring in panel["description"]
        for kind in kinds:
            assert re.search(rf"\b{kind}\b", panel["description"]), f"Records drained: no {kind} ({ring})"
            if ring == "obs_events":
                assert re.search(rf"\b{kind}\b", row), f"docs/metrics.md: obs_events' {kind} not named"


def test_sizing_guidance_quotes_the_idle_benchmark():
    """The Sizing dashboard's idle RSS is the one docs/benchmarks.md prints for the command it names."""
    text = (MIXIN / "dashboards" / "sizing.md").read_text()
    m = re.search(r"([0-9.]+(?:–[0-9.]+)?) MB idle RSS", text)
    assert m and "`bench/storm.py --idle`" in text, "sizing.md: the idle RSS and its command"
    assert m.group(1) + " MB" in (REPO / "docs" / "benchmarks.md").read_text(), m.group(1)


def test_dns_is_not_said_udp_only():
    """capture.dns captures DNS over UDP and over TCP (docs/capture.md, DNS)."""
    for path in MIXIN.rglob("*.libsonnet"):
        prose = " ".join(path.read_text().replace("//", " ").split())   # comments' lines joined
        assert not re.search(r"over UDP(?! or TCP)", prose), path


def test_dashboard_queries_are_plain_promql(tmp_path):
    """Every query, with Grafana's variables substituted, parses as PromQL (promtool parses
    rule expressions, so each becomes a recording rule of a throwaway file)."""
    queries = dashboard_queries(include_variables=True)
    assert {uid for uid, _, _ in queries} == {Path(n).stem for n in DASHBOARD_FILES}
    rules = []
    for i, (uid, title, expr) in enumerate(queries):
        assert "$" not in expr.replace("$1", ""), f"{uid}/{title}: unsubstituted variable in {expr}"
        rules.append({"record": f"dashboard_query_{i}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    proc = subprocess.run([_promtool(), "check", "rules", str(path)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_queries_substitution():
    qs = {(uid, title): expr for uid, title, expr in dashboard_queries()}
    expr = qs[("nettap-overview", "Kernel time per run")]
    assert 'job=~".*", instance=~".*"' in expr and "[1m]" in expr
    assert "> 0)" in expr  # the seed's guard on the denominator
    assert "[5m:]" in qs[("nettap-sizing", "Peak process CPU (cores)")]
