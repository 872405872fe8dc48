"""The mixin as a user installs it: jsonnet-bundler vendors mixin/ alone into a project of its
own, which renders it through `mixin.libsonnet` with `jsonnet -J vendor`, and gets exactly the
files mixin/render.py commits.

With `jb` on PATH, `jb install` vendors it (a local source: no network); without it (the usual
case: jsonnet-bundler is a Go tool no registry here ships), the folder is copied where `jb`
puts a git source's subdirectory, vendor/<host>/<user>/<repo>/<subdir>, with the legacy
vendor/<subdir> link `legacyImports` adds. Only the folder is copied: an import reaching out of
it (`../dashboards`, as before the mixin had a folder of its own) fails here.
"""
import json
import os
import shutil
import subprocess

import pytest
import yaml

from unit.test_mixin import DASHBOARDS, MIXIN, RENDERED

# What a user's jsonnetfile.json names (README.md of the mixin says the same).
REMOTE = "https://github.com/nettap/nettap.git"
SUBDIR = "mixin"
FULL_IMPORT = "github.com/nettap/nettap/mixin/mixin.libsonnet"


def _jsonnet(cwd, expr):
    binary = shutil.which("jsonnet")
    assert binary, "jsonnet not found: install Debian's jsonnet package (scripts/setup.sh test)"
    proc = subprocess.run([binary, "-J", "vendor", "-e", expr], cwd=cwd,
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _vendor(project):
    """Vendors mixin/ into project/vendor as jb would; returns the import path to use."""
    if shutil.which("jb"):
        spec = {"version": 1, "legacyImports": True,
                "dependencies": [{"source": {"local": {"directory": os.path.relpath(MIXIN, project)}},
                                  "version": ""}]}
        (project / "jsonnetfile.json").write_text(json.dumps(spec))
        subprocess.run(["jb", "install"], cwd=project, check=True, capture_output=True, timeout=120)
        return "mixin/mixin.libsonnet"
    spec = {"version": 1, "legacyImports": True,
            "dependencies": [{"source": {"git": {"remote": REMOTE, "subdir": SUBDIR}}, "version": "main"}]}
    (project / "jsonnetfile.json").write_text(json.dumps(spec))
    dest = project / "vendor" / "github.com" / "nettap" / "nettap" / SUBDIR
    shutil.copytree(MIXIN, dest, ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(dest, project / "vendor" / SUBDIR)         # legacyImports: vendor/<last element>
    return FULL_IMPORT


def test_the_mixin_declares_no_dependency():
    """Its jsonnetfile.json is what jb reads of it: no dependency, so vendoring the folder
    alone is all an install does."""
    spec = json.loads((MIXIN / "jsonnetfile.json").read_text())
    assert spec["version"] == 1 and spec["dependencies"] == []


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    return root, _vendor(root)


def test_vendored_mixin_renders_what_is_committed(project):
    root, path = project
    got = _jsonnet(root, f"""
        local m = import '{path}';
        {{ alerts: m.prometheusAlerts, rules: m.prometheusRules, dashboards: m.grafanaDashboards }}""")
    assert got["alerts"] == yaml.safe_load((RENDERED / "nettap-alerts.yaml").read_text())
    assert got["rules"] == yaml.safe_load((RENDERED / "nettap-rules.yaml").read_text())
    committed = {f.name: json.loads(f.read_text()) for f in DASHBOARDS.glob("*.json")}
    assert got["dashboards"] == committed


def test_vendored_mixin_takes_a_users_config(project):
    """The README's override: _config+:: reaches every alert and dashboard, through the legacy
    import name too."""
    root, _ = project
    got = _jsonnet(root, """
        local m = (import 'mixin/mixin.libsonnet') + { _config+:: {
          nettapSelector: 'job="my-nettap"',
          runbookURLPattern: 'https://wiki.example/nettap#%s',
        } };
        { alerts: m.prometheusAlerts, dashboards: m.grafanaDashboards }""")
    rules = [r for g in got["alerts"]["groups"] for r in g["rules"]]
    assert any('job="my-nettap"' in r["expr"] for r in rules)
    assert not any('job="nettap"' in r["expr"] for r in rules)
    assert {r["annotations"]["runbook_url"] for r in rules} == {
        "https://wiki.example/nettap#" + r["alert"].lower() for r in rules}
    overview = json.dumps(got["dashboards"]["nettap-overview.json"])
    assert 'job=\\"my-nettap\\"' in overview
    sizing = got["dashboards"]["nettap-sizing.json"]
    guidance = next(p for p in sizing["panels"] if p["type"] == "text")["options"]["content"]
    assert "https://wiki.example/nettap#sizing-nettap" in guidance
    assert "docs/runbook.md#sizing-nettap" not in guidance
