"""Defaults written in the docs, the example configs and the manifests are
the code's (exporter/config.py), and the sizing the runbook gives is the
DaemonSet's: they drifted apart once (a runbook ring default of 16 MiB
against the code's 8 MiB, 512Mi/1Gi against the DaemonSet's 128Mi/256Mi)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from exporter import config as C

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUNBOOK = ROOT / "docs" / "runbook.md"
DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"
CONFIGMAP = ROOT / "deploy" / "kubernetes" / "configmap.yaml"
COMPOSE_CONFIG = ROOT / "deploy" / "compose" / "nettap.yaml"
MIB = 1 << 20


def _leaves(doc, prefix=()):
    for k, v in doc.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _nested(key: tuple, value) -> dict:
    doc = value
    for k in reversed(key):
        doc = {k: doc}
    return doc


def _readme_config() -> dict:
    text = README.read_text()
    block = re.search(r"```yaml\n# /etc/nettap/nettap\.yaml\n(.*?)```", text, re.S)
    assert block, "README: the config reference block (# /etc/nettap/nettap.yaml) is gone"
    return yaml.safe_load(block.group(1))


def _configmap_config() -> dict:
    return yaml.safe_load(yaml.safe_load(CONFIGMAP.read_text())["data"]["nettap.yaml"])


# Keys each file sets on purpose to something other than the default.
DOCUMENTED = {
    "README config reference": (_readme_config, {("captures",), ("output", "type"), ("output", "path")}),
    "ConfigMap": (_configmap_config, {("captures",)}),
    "compose config": (lambda: yaml.safe_load(COMPOSE_CONFIG.read_text()),
                       {("captures",), ("output", "type"), ("output", "path"), ("output", "max_bytes"),
                        ("output", "backups")}),
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_documented_config_values_are_the_defaults(name):
    load, chosen = DOCUMENTED[name]
    leaves = dict(_leaves(load()))
    assert leaves, name
    for key, value in leaves.items():
        if key in chosen:
            continue
        # Parsed as nettap parses it (0600 is a mode, 8388608 a ring size), one key at
        # a time; output's file keys only go with a file.
        doc = _nested(key, value)
        base = {}
        if key[0] == "output" and key[1] not in ("type", "path"):
            base = {"output": {"type": "jsonl", "path": "/var/lib/nettap/capture.jsonl"}}
            doc["output"].update(base["output"])
        assert C.parse(doc) == C.parse(base), f"{name}: {'.'.join(key)}: {value!r} is not the default"


def test_readme_reference_lists_every_ring_with_its_default():
    assert _readme_config()["rings"] == C.DEFAULT_RING_BYTES


def test_runbook_ring_defaults():
    m = re.search(r"`rings\.capture_chunks` or `rings\.capture_eof` in the\s+config \(bytes, a power of two; "
                  r"defaults (\d+) MiB and (\d+) MiB", RUNBOOK.read_text())
    assert m, "runbook: the sentence giving the ring defaults changed: update this test"
    assert (int(m.group(1)) * MIB, int(m.group(2)) * MIB) == \
        (C.DEFAULT_RING_BYTES["capture_chunks"], C.DEFAULT_RING_BYTES["capture_eof"])


@pytest.mark.parametrize("path", [RUNBOOK, DAEMONSET, README])
def test_queue_bytes_default_where_stated(path):
    said = re.findall(r"output\.queue_bytes`?[^.\n]{0,40}?(\d+) MiB", path.read_text())
    if path != README:
        assert said, f"{path.name}: no mention of output.queue_bytes' default found: update this test"
    assert all(int(n) * MIB == C.DEFAULT_QUEUE_BYTES for n in said), (path.name, said)


def _daemonset_resources() -> dict:
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    (ds,) = [d for d in docs if d.get("kind") == "DaemonSet"]
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "nettap"]
    return c["resources"]


def test_runbook_sizing_matches_the_daemonset():
    text = RUNBOOK.read_text()
    sizing = text[text.index("## Sizing nettap"):]
    block = re.search(r"```yaml\n(resources:.*?)```", sizing, re.S)
    assert block, "runbook: the resources block of Sizing nettap is gone"
    res = _daemonset_resources()
    assert yaml.safe_load(block.group(1))["resources"] == res
    first_row = re.search(r"^\| Up to [^|]*\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|", sizing, re.M)
    assert [x.strip() for x in first_row.groups()] == [res["requests"]["cpu"], res["limits"]["cpu"],
                                                       res["requests"]["memory"], res["limits"]["memory"]]
    assert "128Mi" in text and re.search(r"request (\d+)Mi against", text).group(1) + "Mi" == res["requests"]["memory"]


def test_measured_idle_rss_is_the_same_figure_everywhere():
    rss = {p.name: re.findall(r"idle RSS (?:of )?about (\d+) MiB", p.read_text()) for p in (RUNBOOK, DAEMONSET)}
    assert all(rss.values()), rss
    assert len({n for found in rss.values() for n in found}) == 1, rss


def test_readme_probe_cost_prose_is_the_recorded_table():
    """The prose quoted 225 ns while the benchmark output beside it said 244 once."""
    text = README.read_text()
    # the first table: the tracepoint mechanism's fast variant, what the CI machine runs
    row = re.search(r"^filtered out\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\+(\d+)\s*$", text, re.M)
    assert row, "README: bench/probe_cost.py's recorded output is gone"
    empty_in, empty_out, enter, ret, _, _ = row.groups()
    assert re.search(rf"costs {enter} ns at entry and {ret} ns at return", text)
    assert re.search(rf"a filtered-out call costs \*\*{enter} \+ {ret} ns\*\*", text)
    assert re.search(rf"against\s+{empty_in} and {empty_out} ns for an empty program", text)
    assert re.search(rf"against {empty_in} \+ {empty_out} ns for\s+empty programs", text)
