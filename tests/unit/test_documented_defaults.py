"""Defaults written in the docs, the example configs and the manifests are
the code's (exporter/config.py; the tables of every key are generated from its
declarations, and checked fresh here), and the sizing the runbook gives is the
DaemonSet's: they drifted apart once (a runbook ring default of 16 MiB
against the code's 8 MiB, 512Mi/1Gi against the DaemonSet's 128Mi/256Mi).
Measured figures are not compared here: each is stated once, in
docs/benchmarks.md, and linked from elsewhere."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from exporter import config as C
from exporter.ingest import settings as ingest_settings
from exporter.util import schema

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
RUNBOOK = ROOT / "docs" / "runbook.md"
DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"
CONFIGMAP = ROOT / "deploy" / "kubernetes" / "configmap.yaml"
COMPOSE_CONFIG = ROOT / "deploy" / "compose" / "nettap.yaml"
CHART_VALUES = ROOT / "deploy" / "helm" / "nettap" / "values.yaml"
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


def _config_block(path: Path) -> str:
    block = re.search(r"```yaml\n# /etc/nettap/nettap\.yaml\n(.*?)```", path.read_text(), re.S)
    assert block, f"{path.name}: the config block (# /etc/nettap/nettap.yaml) is gone"
    return block.group(1)


def _reference_config() -> dict:
    """docs/configuration.md's reference: every key, at its default."""
    return yaml.safe_load(_config_block(CONFIG_DOC))


def _readme_config() -> dict:
    """The README's minimal config."""
    return yaml.safe_load(_config_block(README))


def _configmap_config() -> dict:
    return yaml.safe_load(yaml.safe_load(CONFIGMAP.read_text())["data"]["nettap.yaml"])


# Keys each file sets on purpose to something other than the default.
DOCUMENTED = {
    "config reference": (_reference_config, {("captures",), ("output", "type"), ("output", "path")}),
    "README minimal config": (_readme_config, {("captures",), ("output", "type"), ("output", "path")}),
    "ConfigMap": (_configmap_config, {("captures",), ("output", "type"), ("output", "path"), ("output", "mode"),
                                      ("ingest", "servers"), ("ingest", "stream", "replicas"),
                                      ("kubernetes", "kubelet_url")}),       # off: no RBAC, no token
    # The chart's ingest.servers, not its config, names the engine.
    "Helm chart's ebpf.configuration": (lambda: yaml.safe_load(CHART_VALUES.read_text())["ebpf"]["configuration"],
                                        {("captures",), ("output", "type"), ("output", "path"), ("output", "mode"),
                                         ("ingest", "stream", "replicas")}),
    "compose config": (lambda: yaml.safe_load(COMPOSE_CONFIG.read_text()),
                       {("captures",), ("output", "type"), ("output", "path"), ("output", "max_bytes"),
                        ("output", "backups"), ("ingest", "servers"), ("ingest", "stream", "max_bytes")}),
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
        # a time; output's file keys only go with a file; ingest's section as ingest parses it.
        doc = _nested(key, value)
        if key[0] == "ingest" and len(key) > 1:
            out = C.parse({"output": {"type": "jsonl", "path": "/var/lib/nettap/capture.jsonl"}}).output
            assert ingest_settings.parse(doc["ingest"], out) == ingest_settings.parse({}, out), \
                f"{name}: {'.'.join(key)}: {value!r} is not the default"
            continue
        base = {}
        if key[0] == "output" and key[1] not in ("type", "path"):
            base = {"output": {"type": "jsonl", "path": "/var/lib/nettap/capture.jsonl"}}
            doc["output"].update(base["output"])
        assert C.parse(doc) == C.parse(base), f"{name}: {'.'.join(key)}: {value!r} is not the default"


def test_reference_lists_every_ring_with_its_default():
    assert _reference_config()["rings"] == C.DEFAULT_RING_BYTES


def _allowed(section: tuple) -> set:
    """The keys config.parse accepts in a section, as its refusal of an unknown key lists them."""
    with pytest.raises(C.ConfigError) as e:
        C.parse(_nested(section + ("no_such_key",), 1))
    return set(re.search(r"expected one of (.*)\)$", str(e.value))[1].split(", "))


def test_reference_lists_every_key():
    """Every key config.parse accepts is in the reference (but output.queue_records,
    deprecated: the page says so in prose), and no other."""
    def walk(node: dict, section: tuple):
        assert set(node) == _allowed(section) - {"queue_records"}, section
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, section + (k,))
    walk(_reference_config(), ())


def test_readme_minimal_config_is_accepted():
    """The README's config parses as nettap parses a file, and captures something."""
    cfg = C.loads(_config_block(README), "README")
    assert cfg.captures and cfg.output.type == "jsonl"


def test_runbook_ring_defaults():
    m = re.search(r"`rings\.capture_chunks` or `rings\.capture_eof` in the\s+config \(bytes, a power of two; "
                  r"defaults (\d+) MiB and (\d+) MiB", RUNBOOK.read_text())
    assert m, "runbook: the sentence giving the ring defaults changed: update this test"
    assert (int(m.group(1)) * MIB, int(m.group(2)) * MIB) == \
        (C.DEFAULT_RING_BYTES["capture_chunks"], C.DEFAULT_RING_BYTES["capture_eof"])


@pytest.mark.parametrize("path", [RUNBOOK, DAEMONSET, README, CONFIG_DOC])
def test_queue_bytes_default_where_stated(path):
    said = re.findall(r"output\.queue_bytes`?[^.\n]{0,40}?(\d+) MiB", path.read_text())
    said += re.findall(r"^\s*queue_bytes: \d+\s+# [^(\n]*\((\d+) MiB\)", path.read_text(), re.M)
    if path in (RUNBOOK, DAEMONSET, CONFIG_DOC):
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


# ---- the key tables, generated from the parsers' declarations ---------------------------------

_spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "scripts" / "gen_config_doc.py")
gen_config_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_config_doc)


def _declared(section, out=None) -> dict:
    """{dotted key: Key} of every leaf key below section."""
    out = {} if out is None else out
    for k in section.keys.values():
        if isinstance(k.check, schema.Section):
            _declared(k.check, out)
        else:
            out[section.key(k.name)] = k
    return out


def test_key_tables_are_fresh():
    """docs/configuration.md's tables are what scripts/gen_config_doc.py renders now."""
    text = CONFIG_DOC.read_text()
    assert gen_config_doc.with_tables(text) == text, "run scripts/gen_config_doc.py"


def test_a_stale_key_table_is_caught(monkeypatch):
    """The freshness check fails on a table edited by hand, and on a default changed in code only."""
    text = CONFIG_DOC.read_text()
    row = "| `capture.max_payload_bytes` | integer, 0 .. 65736 | `4096` |"
    assert row in text
    edited = text.replace(row, row.replace("`4096`", "`8192`"))
    assert gen_config_doc.with_tables(edited) != edited
    key = C.CAPTURE.keys["max_payload_bytes"]
    monkeypatch.setitem(C.CAPTURE.keys, "max_payload_bytes", key._replace(default=8192))
    assert gen_config_doc.with_tables(text) != text


def test_declared_defaults_are_the_parsers_and_the_references():
    """Every key's declared default is what the parser gives for an empty file, and what the
    reference block above the tables says, where it gives the key."""
    cfg = C.parse({"output": {"type": "jsonl", "path": "x"}})
    keys = _declared(C.TOP)
    assert keys["capture.max_payload_bytes"].default == cfg.max_payload_bytes
    assert keys["capture.tls"].default is cfg.tls is False
    for name in ("root", "max_bytes", "backups", "queue_bytes", "mode"):
        assert keys[f"output.{name}"].default == getattr(cfg.output, name)
    assert {k: keys[f"rings.{k}"].default for k in C.DEFAULT_RING_BYTES} == cfg.ring_bytes
    assert (keys["diagnostics.bpfStats.enabled"].default, keys["diagnostics.bpfStats.scope"].default,
            keys["log_level"].default) == (cfg.bpf_stats_enabled, cfg.bpf_stats_scope, cfg.log_level)
    reference = {".".join(k): v for k, v in _leaves(_reference_config())}
    for key, k in keys.items():
        if key in reference and key not in ("output.type", "output.path", "captures"):
            assert reference[key] == k.default, key
    s = ingest_settings.parse({}, cfg.output)
    ingest = _declared(ingest_settings.INGEST)
    assert ingest["ingest.stream.max_age"].default == s.stream.max_age
    assert ingest["ingest.batch_bytes"].default == s.batch_bytes
    assert ingest["ingest.ack_timeout"].default == s.ack_timeout
