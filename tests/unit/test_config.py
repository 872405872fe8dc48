"""exporter.config: every refused config names the key and the reason."""
from __future__ import annotations

import os

import pytest

from exporter.capture import records as R

from exporter import config
from exporter.config import Config, ConfigError, Output, Target

FULL = """\
captures:
  - pid: 4242
  - cgroup: /sys/fs/cgroup/system.slice/nginx.service
  - netns: /var/run/netns/blue
  - netns: 4026531840
  - port: 443
    segments: true
capture:
  max_payload_bytes: 65736
  tls_attach: node
  dns: true
output:
  type: jsonl
  path: /var/log/nettap/capture.jsonl
  root: /var/log/nettap
  max_bytes: 4096
  backups: 0
  queue_bytes: 65536
  mode: 0640
rings:
  capture_chunks: 1073741824
  capture_eof: 4096
  logs: 8192
diagnostics:
  bpfStats:
    enabled: true
    scope: node
log_level: debug
"""


MODE_MSG = ("output.mode: must be an octal file mode with read-write for the owner and no write or execute "
            "for others, e.g. 0600 or 0640")


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        config.loads(text)
    return str(e.value)


def test_full_config():
    d = config.DEFAULT_RECORDS      # each target's kinds: capture.records; with segment where it asks
    assert config.loads(FULL) == Config(
        captures=(Target("pid", 4242, False, d),
                  Target("cgroup", "/sys/fs/cgroup/system.slice/nginx.service", False, d),
                  Target("netns", "/var/run/netns/blue", False, d), Target("netns", 4026531840, False, d),
                  Target("port", 443, True, tuple(k for k in config.RECORD_KINDS if k in d + ("segment",)))),
        max_payload_bytes=65736,
        output=Output("jsonl", "/var/log/nettap/capture.jsonl", 4096, 0, 65536, 0o640, "/var/log/nettap"),
        rings=(("capture_chunks", 1 << 30), ("capture_eof", 4096), ("logs", 8192), ("obs_events", 1 << 20),
               ("dlopen", 64 << 10), ("segments", 256 << 10), ("dns", 1 << 20)),
        bpf_stats_enabled=True, bpf_stats_scope="node", log_level="debug", dns=True, tls_attach="node")


def test_full_config_accessors():
    cfg = config.loads(FULL)
    assert cfg.ring_bytes == {"capture_chunks": 1 << 30, "capture_eof": 4096, "logs": 8192, "obs_events": 1 << 20,
                              "dlopen": 64 << 10, "segments": 256 << 10, "dns": 1 << 20}
    assert [str(t) for t in cfg.captures] == [
        "pid=4242", "cgroup=/sys/fs/cgroup/system.slice/nginx.service", "netns=/var/run/netns/blue",
        "netns=4026531840", "port=443 (segments)"]


def test_a_targets_own_records():
    """records: on a target replaces capture.records for its sockets; segments:
    true adds segment; Config.kinds is the union (what the programs follow)."""
    cfg = config.loads("captures: [{port: 80, records: all}, {pid: 1, records: [eof], segments: true}, {port: 81}]\n"
                       "capture: {records: [owner]}\n")
    assert [t.records for t in cfg.captures] == [config.RECORD_KINDS, ("eof", "segment"), ("owner",)]
    assert cfg.kinds == frozenset(config.RECORD_KINDS)
    assert config.loads("captures: [{port: 80, records: [segment]}]").captures[0].segments is True
    assert refused("captures: [{port: 80, records: []}]") == \
        "captures[0].records: must name a record kind at least (or all)"
    assert refused("captures: [{port: 80, records: [bytes]}]").startswith(
        "captures[0].records: unknown record kind 'bytes'")


@pytest.mark.parametrize("text", ["{}", "---\n", "# only a comment\n", "captures: []\n", "captures:\n"])
def test_defaults(text):
    assert config.loads(text) == config.DEFAULT


@pytest.mark.parametrize("text", ["", " \n\n"])
def test_empty_file_refused(text):
    # An editor's truncate-then-write must not drop the captures for a poll.
    with pytest.raises(ConfigError, match=r"the file is empty \(write \{\} for the built-in defaults\)"):
        config.loads(text, "nettap.yaml")


def test_default_values():
    d = config.DEFAULT
    assert (d.captures, d.max_payload_bytes, d.bpf_stats_enabled, d.bpf_stats_scope, d.log_level, d.tls,
            d.tls_attach) == ((), 4096, False, "own", "info", False, "targets")
    assert d.output == Output("none", None, 100 << 20, 3, 4 << 20)
    assert d.ring_bytes == {"capture_chunks": 8 << 20, "capture_eof": 2 << 20, "logs": 64 << 10, "obs_events": 1 << 20,
                            "dlopen": 64 << 10, "segments": 256 << 10, "dns": 1 << 20}


def test_partial_sections_keep_defaults():
    cfg = config.loads("output: {type: stdout}\nrings: {logs: 4096}\ndiagnostics: {bpfStats: {enabled: true}}\n")
    assert cfg.output == Output("stdout", None, 100 << 20, 3, 4 << 20)
    assert cfg.ring_bytes == {"capture_chunks": 8 << 20, "capture_eof": 2 << 20, "logs": 4096, "obs_events": 1 << 20,
                              "dlopen": 64 << 10, "segments": 256 << 10, "dns": 1 << 20}
    assert (cfg.bpf_stats_enabled, cfg.bpf_stats_scope) == (True, "own")


# ---- refused configs ------------------------------------------------------

def test_bad_yaml_names_line_and_column():
    assert refused("log_level: info\na: b\n  c: d\n") == (
        "<config>: not valid YAML at line 3, column 4: mapping values are not allowed here")


def test_bad_yaml_unclosed_flow():
    assert refused("captures: [\n  {pid: 1\n") == (
        "<config>: not valid YAML at line 3, column 1: expected ',' or '}', but got '<stream end>'")


def test_two_yaml_documents():
    assert refused("log_level: info\n---\nlog_level: debug\n") == (
        "<config>: not valid YAML at line 2, column 1: but found another document")


ROOT_MSG = "output.path: must name a file inside output.root (/var/lib/nettap; relative paths are taken from it), "


@pytest.mark.parametrize("text, msg", [
    ("captures: {pid: 1}", "captures: must be a list, got dict"),
    ("captures: pid=1", "captures: must be a list, got str"),
    ("captures:\n- port: 80\n- port: http",
     "captures[1].port: must be an integer from 1 to 65535, got 'http'"),
    ("captures: [{port: 0}]", "captures[0].port: must be an integer from 1 to 65535, got 0"),
    ("captures: [{port: 65536}]", "captures[0].port: must be an integer from 1 to 65535, got 65536"),
    ("captures: [{port: true}]", "captures[0].port: must be an integer from 1 to 65535, got True"),
    ("captures: [{port: 80.0}]", "captures[0].port: must be an integer from 1 to 65535, got 80.0"),
    ("captures: [{pid: -1}]", "captures[0].pid: must be an integer from 1 to 4194303, got -1"),
    ("captures: [{pid: false}]", "captures[0].pid: must be an integer from 1 to 4194303, got False"),
    ("captures: [{pid: '42'}]", "captures[0].pid: must be an integer from 1 to 4194303, got '42'"),
    ("captures: [{netns: 0}]", "captures[0].netns: must be an integer from 1 to 4294967295, got 0"),
    ("captures: [{netns: true}]", "captures[0].netns: must be a non-empty string, got True"),
    ("captures: [{cgroup: ''}]", "captures[0].cgroup: must be a non-empty string, got ''"),
    ("captures: [{cgroup: sys/fs/cgroup/x}]",
     "captures[0].cgroup: must be an absolute path, got 'sys/fs/cgroup/x'"),
    ("captures: [{netns: run/netns/blue}]",
     "captures[0].netns: must be an absolute path, got 'run/netns/blue'"),
    ("captures: [{proc: 1}]",
     "captures[0].proc: unknown capture kind (expected one of pid, cgroup, netns, port, kubernetes)"),
    ("captures: [{pid: 1, port: 2}]",
     "captures[0]: must be a mapping with exactly one of pid, cgroup, netns, port, kubernetes "
     "(and optionally segments, records), got {'pid': 1, 'port': 2}"),
    ("captures: [{}]", "captures[0]: must be a mapping with exactly one of pid, cgroup, netns, port, kubernetes "
     "(and optionally segments, records), got {}"),
    ("captures: [{port: 80, segments: 1}]", "captures[0].segments: must be true or false, got 1"),
    ("captures: [{segments: true}]", "captures[0]: must be a mapping with exactly one of pid, cgroup, netns, port, "
                                    "kubernetes (and optionally segments, records), got {'segments': True}"),
    ("captures: [{kubernetes: {container: api}}]", "captures[0].kubernetes: a container alone would name that "
     "container in every pod of the node: give namespace, pod or labels too"),
    ("captures: [{kubernetes: {labels: {}, container: api}}]", "captures[0].kubernetes.labels: an empty mapping "
     "would name every pod of the node: give a label, or namespace or pod"),
    ("captures: [{kubernetes: {labels: {}}}]", "captures[0].kubernetes.labels: an empty mapping would name every pod "
     "of the node: give a label, or namespace or pod"),
    ("captures: [{kubernetes: {}}]", "captures[0].kubernetes: must be a mapping of namespace, pod, labels, container "
     "(at least one), got {}"),
    ("captures: [{kubernetes: shop}]", "captures[0].kubernetes: must be a mapping of namespace, pod, labels, "
     "container (at least one), got 'shop'"),
    ("captures: [{kubernetes: {namespace: Shop}}]", "captures[0].kubernetes.namespace: must be a Kubernetes name "
     "(lower case letters, digits, - and .), got 'Shop'"),
    ("captures: [{kubernetes: {pod: 'a/b'}}]", "captures[0].kubernetes.pod: must be a pod name or a glob of one "
     "(* ? [...]), got 'a/b'"),
    ("captures: [{kubernetes: {namespace: a, nme: b}}]", "captures[0].kubernetes.nme: unknown key (expected one of "
     "namespace, pod, labels, container)"),
    ("captures: [{kubernetes: {labels: [app]}}]", "captures[0].kubernetes.labels: must be a mapping of label to "
     "value, got ['app']"),
    ("captures: [{kubernetes: {labels: {app: 3}}}]", "captures[0].kubernetes.labels.app: must be a label value (a "
     "string of at most 63 letters, digits, - _ .), got 3"),
    ("captures: [{kubernetes: {labels: {'a b': x}}}]", "captures[0].kubernetes.labels: 'a b' is not a label key"),
    ("kubernetes: {kubelet_url: 'http://node:10255/pods'}", "kubernetes.kubelet_url: must be auto, off or an https "
     "URL of the kubelet's /pods (its token is not sent in the clear), got 'http://node:10255/pods'"),
    ("kubernetes: {poll_seconds: 0}", "kubernetes.poll_seconds: must be an integer from 1 to 3600, got 0"),
    ("kubernetes: {pol_seconds: 1}", "kubernetes.pol_seconds: unknown key (expected one of kubelet_url, token_file, "
     "ca_file, insecure_skip_verify, poll_seconds, timeout_seconds, max_bytes, cgroup_root, cgroup_poll_ms)"),
    ("metrics: {kubernetes_labels: yes please}", "metrics.kubernetes_labels: must be true or false, got 'yes please'"),
    ("metrics: {kubernetes_max_series: 0}", "metrics.kubernetes_max_series: must be an integer from 1 to 100000, "
     "got 0"),
    ("captures: [7]", "captures[0]: must be a mapping with exactly one of pid, cgroup, netns, port, kubernetes "
     "(and optionally segments, records), got 7"),
    ("foo: 1", "foo: unknown key (expected one of captures, capture, output, rings, diagnostics, kubernetes, metrics, "
     "log_level, ingest)"),
    ("output: {pth: /x}",
     "output.pth: unknown key (expected one of type, path, root, max_bytes, backups, queue_bytes, queue_records, "
     "mode)"),
    ("capture: {max_bytes: 1}",
     "capture.max_bytes: unknown key (expected one of max_payload_bytes, tls, tls_attach, dns, records, "
     "sample_connections)"),
    ("capture: {dns: 1}", "capture.dns: must be true or false, got 1"),
    ("capture: {tls: 1}", "capture.tls: must be true or false, got 1"),
    ("capture: {tls: 'yes'}", "capture.tls: must be true or false, got 'yes'"),
    ("capture: {tls_attach: all}", "capture.tls_attach: must be one of targets, node, got 'all'"),
    ("capture: {tls_attach: true}", "capture.tls_attach: must be one of targets, node, got True"),
    ("capture: {tls_attach: Node}", "capture.tls_attach: must be one of targets, node, got 'Node'"),
    ("diagnostics: {bpfstats: {}}", "diagnostics.bpfstats: unknown key (expected one of bpfStats)"),
    ("diagnostics: {bpfStats: {enabled: true, extra: 1}}",
     "diagnostics.bpfStats.extra: unknown key (expected one of enabled, scope)"),
    ("rings: {bogus: 4096}",
     "rings.bogus: unknown key (expected one of capture_chunks, capture_eof, logs, obs_events, dlopen, segments, dns)"),
    ("output: [1]", "output: must be a mapping, got list"),
    ("diagnostics: {bpfStats: 1}", "diagnostics.bpfStats: must be a mapping, got int"),
    ("capture: {max_payload_bytes: 65737}",
     "capture.max_payload_bytes: must be an integer from 0 to 65736, got 65737"),
    ("capture: {max_payload_bytes: -1}",
     "capture.max_payload_bytes: must be an integer from 0 to 65736, got -1"),
    ("rings: {logs: 5000}", "rings.logs: must be a power of two (the kernel's ring rule), got 5000"),
    ("rings: {logs: 2048}", "rings.logs: must be an integer from 4096 to 1073741824, got 2048"),
    ("rings: {capture_chunks: 2147483648}",
     "rings.capture_chunks: must be an integer from 4096 to 1073741824, got 2147483648"),
    ("rings: {capture_eof: 4096.0}", "rings.capture_eof: must be an integer from 4096 to 1073741824, got 4096.0"),
    ("output: {type: jsonl}", "output.path: must be a non-empty string, got None"),
    ("output: {type: jsonl, path: ''}", "output.path: must be a non-empty string, got ''"),
    ("output: {path: /var/lib/nettap/x}", "output.path: only used with type jsonl (type is none)"),
    ("output: {type: none, path: /var/lib/nettap/x}", "output.path: only used with type jsonl (type is none)"),
    ("output: {type: stdout, path: /var/lib/nettap/x}", "output.path: only used with type jsonl (type is stdout)"),
    ("output: {type: file}", "output.type: must be one of jsonl, stdout, none, got 'file'"),
    # issue 45: only inside output.root (/var/lib/nettap by default), whatever the path says
    ("output: {type: jsonl, path: /etc/passwd}", ROOT_MSG + "got '/etc/passwd': nettap writes only there"),
    ("output: {type: jsonl, path: /var/lib/nettap/../../etc/x}",
     ROOT_MSG + "got '/var/lib/nettap/../../etc/x': nettap writes only there"),
    ("output: {type: jsonl, path: ../x}", ROOT_MSG + "got '../x': nettap writes only there"),
    ("output: {type: jsonl, path: /var/lib/nettap}", ROOT_MSG + "got '/var/lib/nettap': nettap writes only there"),
    ("output: {type: jsonl, path: /var/lib/nettapx/y}",
     ROOT_MSG + "got '/var/lib/nettapx/y': nettap writes only there"),
    ("output: {type: jsonl, path: /x, root: /}",
     "output.root: must be an absolute path to nettap's own directory (not /), got '/'"),
    ("output: {type: jsonl, path: x, root: var/x}",
     "output.root: must be an absolute path to nettap's own directory (not /), got 'var/x'"),
    ("output: {type: jsonl, path: x, root: ''}", "output.root: must be a non-empty string, got ''"),
    ("output: {type: stdout, root: /x}", "output.root: only used with type jsonl (type is stdout)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, max_bytes: 4095}",
     "output.max_bytes: must be an integer from 4096 to 1099511627776, got 4095"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, backups: -1}",
     "output.backups: must be an integer from 0 to 1000, got -1"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, queue_records: 1023}",
     "output.queue_records: must be an integer from 1024 to 67108864, got 1023"),
    ("output: {queue_bytes: 65535}", "output.queue_bytes: must be an integer from 65536 to 1099511627776, got 65535"),
    ("output: {queue_bytes: 1099511627777}",
     "output.queue_bytes: must be an integer from 65536 to 1099511627776, got 1099511627777"),
    ("output: {queue_bytes: 16MiB}", "output.queue_bytes: must be an integer from 65536 to 1099511627776, got '16MiB'"),
    ("output: {queue_bytes: true}", "output.queue_bytes: must be an integer from 65536 to 1099511627776, got True"),
    ("output: {queue_bytes: 1048576.0}",
     "output.queue_bytes: must be an integer from 65536 to 1099511627776, got 1048576.0"),
    ("output: {queue_bytes: 1048576, queue_records: 4096}",
     "output.queue_records: deprecated alias of output.queue_bytes; give only queue_bytes"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: 0666}", MODE_MSG + ", got 438 (octal 666)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: 0620}", MODE_MSG + ", got 400 (octal 620)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: 0700}", MODE_MSG + ", got 448 (octal 700)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: 0400}", MODE_MSG + ", got 256 (octal 400)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: 600}", MODE_MSG + ", got 600 (octal 1130)"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: '0666'}", MODE_MSG + ", got '0666'"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: rw}", MODE_MSG + ", got 'rw'"),
    ("output: {type: jsonl, path: /var/lib/nettap/x, mode: true}", MODE_MSG + ", got True"),
    ("output: {type: stdout, mode: 0600}", "output.mode: only used with type jsonl (type is stdout)"),
    ("diagnostics: {bpfStats: {enabled: 'yes'}}", "diagnostics.bpfStats.enabled: must be true or false, got 'yes'"),
    ("diagnostics: {bpfStats: {enabled: 1}}", "diagnostics.bpfStats.enabled: must be true or false, got 1"),
    ("diagnostics: {bpfStats: {scope: all}}", "diagnostics.bpfStats.scope: must be one of own, node, got 'all'"),
    ("log_level: verbose", "log_level: must be one of debug, info, warn, warning, error, got 'verbose'"),
    ("log_level: DEBUG", "log_level: must be one of debug, info, warn, warning, error, got 'DEBUG'"),
])
def test_refused(text, msg):
    assert refused(text) == msg


@pytest.mark.parametrize("text,mode", [
    ("", 0o600), ("mode: 0640", 0o640), ("mode: '0640'", 0o640), ("mode: '0o644'", 0o644),
    ("mode: 0o604", 0o604)])                # YAML 1.1 reads 0o604 as a string
def test_output_mode(text, mode):
    assert config.loads("output: {type: jsonl, path: /var/lib/nettap/x, %s}" % text).output.mode == mode


def test_queue_bytes():
    assert config.loads("output: {queue_bytes: 65536}").output.queue_bytes == 65536
    assert config.loads("output: {queue_bytes: 1099511627776}").output.queue_bytes == 1 << 40


def test_queue_records_is_a_deprecated_alias(caplog):
    """The old record bound is read as that many chunk records' bytes (the
    memory it used to allow), with a warning naming the new key."""
    with caplog.at_level("WARNING", logger="exporter.config"):
        cfg = config.loads("output: {queue_records: 4096}")
    assert cfg.output.queue_bytes == 4096 * 512
    assert [r.getMessage() for r in caplog.records] == [
        "output.queue_records is deprecated: read as output.queue_bytes: 2097152 (4096 chunk records of 512 bytes)"]


def test_ring_size_need_not_be_a_multiple_of_a_record():
    # Records of several sizes share a ring; one that crosses its end is read whole.
    assert config.loads("rings: {capture_eof: 4096}").ring_bytes["capture_eof"] == 4096
    assert 4096 % R.STRIDES["capture_eof"]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- load() -----------------------------------------------------------------

def test_load_file(tmp_path):
    p = tmp_path / "nettap.yaml"
    p.write_text(FULL)
    assert config.load(str(p)) == config.loads(FULL)


def test_load_missing_file(tmp_path):
    p = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == f"{p}: cannot read: No such file or directory"


def test_load_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: cannot read: Is a directory"


def test_load_not_utf8(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"log_level: info\n# caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == (f"{p}: not UTF-8 text: 'utf-8' codec can't decode byte 0xe9 "
                            "in position 21: invalid continuation byte")


def test_load_bad_yaml_names_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("log_level: info\nlog_level: [\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value).startswith(f"{p}: not valid YAML at line 3, column 1: ")


# ---- bounds: what a file may ask of the parser -----------------------------

def test_deep_nesting_refused_in_one_line():
    # Was a RecursionError traceback (rc 1 at start; live, a traceback with
    # last_reload_successful still 1).
    msg = refused("captures: " + "[" * 50_000 + "]" * 50_000 + "\n")
    # the mapping is a level
    assert msg == f"<config>: nested deeper than {config.MAX_DEPTH} levels at line 1, column {10 + config.MAX_DEPTH}"


def test_nesting_at_the_bound_is_parsed():
    doc = "x: " + "[" * (config.MAX_DEPTH - 1) + "]" * (config.MAX_DEPTH - 1)
    assert refused(doc).startswith("x: unknown key")


BOMB = """\
a: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
captures: [*d]
"""


def test_alias_bomb_refused_short():
    # 218 bytes of aliases made a 5.8 MB error line.
    assert len(BOMB) < 220
    assert refused(BOMB) == ("<config>: YAML aliases are not supported (*a at line 2, column 8): "
                             "write the value out")


def test_merge_key_needs_an_alias_and_is_refused():
    assert "YAML aliases are not supported" in refused("x: &x {a: 1}\ny:\n  <<: *x\n")


def test_too_many_nodes_refused():
    text = "captures:\n" + "  - port: 80\n" * (config.MAX_NODES // 3 + 1)
    assert refused(text) == f"<config>: more than {config.MAX_NODES} YAML nodes; a config is far smaller"


def test_refused_value_quoted_bounded():
    msg = refused("log_level: " + "v" * 100_000 + "\n")
    assert msg.startswith("log_level: must be one of debug, info, warn, warning, error, got 'vvvv")
    assert "..." in msg and len(msg) < 160


def test_refused_structure_quoted_bounded():
    msg = refused("captures: [{pid: 1, port: [" + ", ".join(["[1, 2, 3, 4, 5, 6]"] * 5000) + "]}]\n")
    assert len(msg) < 200 and "\n" not in msg


@pytest.mark.parametrize("key", ["a\nb", "x" * 5000, "  padded", "tab\there", 7])
def test_unknown_key_quoted_when_not_a_plain_name(key):
    import yaml
    msg = refused(yaml.safe_dump({key: 1}))
    assert "\n" not in msg and "\t" not in msg and len(msg) < 200
    assert msg.startswith(config.quote(key)[:40])


def test_key_with_newline_does_not_make_a_second_line():
    msg = refused('output: {"pth\\n2026-01-01 ERROR nettap: forged": 1}\n')
    assert msg.startswith("output.'pth\\n2026-01-01 ERROR nettap: forged': unknown key")


def test_bad_yaml_problem_is_one_line():
    msg = refused("a: !!python/object:os.system " + "x" * 10 + "\n")
    assert "\n" not in msg and msg.startswith("<config>: not valid YAML")


def test_load_too_big_file_refused_without_reading_it(tmp_path):
    p = tmp_path / "big.yaml"
    with open(p, "wb") as f:
        f.truncate(50 << 20)                     # 50 MB (sparse): was over a minute at 1.3 GB RSS
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == f"{p}: larger than 1048576 bytes (52428800 bytes); a config is a few KiB"


def test_load_at_the_size_bound(tmp_path):
    p = tmp_path / "max.yaml"
    text = "log_level: info\n"
    p.write_text(text + "#" * (config.MAX_FILE_BYTES - len(text) - 1) + "\n")
    assert config.load(str(p)) == config.DEFAULT


def test_load_fifo_refused_without_blocking(tmp_path):
    p = tmp_path / "fifo.yaml"
    os.mkfifo(p)
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == f"{p}: not a regular file"


def test_load_symlink_loop(tmp_path):
    p = tmp_path / "loop.yaml"
    p.symlink_to(p.name)
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == f"{p}: cannot read: Too many levels of symbolic links"


# ---- load_apart(): the parse of a live reload, in a child -------------------

def test_load_apart_same_config(tmp_path):
    p = tmp_path / "nettap.yaml"
    p.write_text(FULL)
    assert config.load_apart(str(p)) == config.load(str(p))


@pytest.mark.parametrize("text", [BOMB, "x: [\n", "captures: " + "[" * 50_000, "foo: 1\n", ""])
def test_load_apart_same_refusal(tmp_path, text):
    p = tmp_path / "nettap.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as inside:
        config.load(str(p))
    with pytest.raises(ConfigError) as apart:
        config.load_apart(str(p))
    assert str(apart.value) == str(inside.value)


def test_a_reload_with_a_bad_tls_attach_is_refused_before_it_applies(tmp_path):
    """A live reload parses apart (Nettap.reload: apply(load_apart(path))):
    the refusal names the key and comes before anything is applied, so the
    config in force stays; the file fixed, it loads."""
    p = tmp_path / "nettap.yaml"
    p.write_text("capture: {tls: true, tls_attach: pods}\n")
    with pytest.raises(ConfigError) as e:
        config.load_apart(str(p))
    assert str(e.value) == "capture.tls_attach: must be one of targets, node, got 'pods'"
    p.write_text("capture: {tls: true, tls_attach: node}\n")
    assert (config.load_apart(str(p)).tls, config.load_apart(str(p)).tls_attach) == (True, "node")


def test_load_apart_other_document(tmp_path):
    p = tmp_path / "web.yml"
    p.write_text("basic_auth_users: {a: b}\n")
    assert config.load_apart(str(p), parse_doc=lambda d: d) == {"basic_auth_users": {"a": "b"}}


def test_load_apart_timeout_kills_the_child(tmp_path):
    p = tmp_path / "nettap.yaml"
    p.write_text(FULL)
    with pytest.raises(ConfigError, match=r"parsing took longer than 0.001 s"):
        config.load_apart(str(p), timeout=0.001)


def test_cancel_loads_kills_a_running_parse(tmp_path, monkeypatch):
    import threading
    import time
    from exporter.util import apart
    monkeypatch.setattr(apart, "_cancelled", False)
    p = tmp_path / "nettap.yaml"
    p.write_text(FULL)
    # A parse that never ends: the child's stdin is held open by a slow reader.
    real_popen = __import__("subprocess").Popen
    started = threading.Event()

    class SlowPopen(real_popen):
        def __init__(self, args, **kw):
            super().__init__([args[0], "-c", "import time; time.sleep(60)"], **kw)
            started.set()
    monkeypatch.setattr("subprocess.Popen", SlowPopen)
    errors = []

    def run():
        try:
            config.load_apart(str(p))
        except ConfigError as e:
            errors.append(str(e))
    t = threading.Thread(target=run)
    t.start()
    assert started.wait(10)
    t0 = time.monotonic()
    config.cancel_loads()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 2
    assert errors == [f"{p}: parse cancelled (nettap is stopping)"]
    with pytest.raises(ConfigError, match="cancelled"):
        config.load_apart(str(p))


def test_a_failed_parser_says_its_exit_status_and_last_words(tmp_path, monkeypatch):
    from exporter.util import apart
    p = tmp_path / "nettap.yaml"
    p.write_text(FULL)
    real_run = apart.run
    # the child nettap would run, asked for a function that is not there: it fails, as a crash would
    monkeypatch.setattr(apart, "run", lambda module, function, *a: real_run(module, "no_such_function", *a))
    with pytest.raises(ConfigError) as e:
        config.load_apart(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}: the YAML parser failed (exit status 1): \"ImportError: cannot import name"), msg
    assert len(msg) - len(str(p)) < 130            # its last words quoted, bounded


@pytest.mark.parametrize("text, path, root", [
    ("path: capture.jsonl", "/var/lib/nettap/capture.jsonl", "/var/lib/nettap"),
    ("path: ./a/../capture.jsonl", "/var/lib/nettap/capture.jsonl", "/var/lib/nettap"),
    ("path: /srv/cap/x.jsonl, root: /srv/cap/", "/srv/cap/x.jsonl", "/srv/cap"),
    ("path: d/x.jsonl, root: /srv/cap", "/srv/cap/d/x.jsonl", "/srv/cap"),
])
def test_output_path_is_taken_inside_the_root(text, path, root):
    out = config.loads("output: {type: jsonl, %s}" % text).output
    assert (out.path, out.root) == (path, root)


def test_kubernetes_target_and_sections():
    c = config.loads("captures: [{kubernetes: {namespace: shop, pod: 'checkout-*', labels: {app: checkout, tier: web}, "
              "container: api}, records: [owner, eof]}]\nkubernetes: {kubelet_url: off, poll_seconds: 2}\n"
              "metrics: {kubernetes_labels: true}")
    t = c.captures[0]
    assert (t.kind, t.value.namespace, t.value.pod, t.value.labels, t.value.container, t.records) == \
        ("kubernetes", "shop", "checkout-*", (("app", "checkout"), ("tier", "web")), "api", ("eof", "owner"))
    assert str(t.value) == "namespace=shop,pod=checkout-*,label app=checkout,label tier=web,container=api"
    assert t.value.matches("shop", "checkout-1", {"app": "checkout", "tier": "web", "x": "y"})
    assert not t.value.matches("shop", "checkout-1", {"app": "checkout"})
    assert not t.value.matches("shop", "cart-1", {"app": "checkout", "tier": "web"})
    assert (c.kube.kubelet_url, c.kube.poll_seconds, c.kube.kubernetes_labels) == ("off", 2, True)
    assert config.loads("{}").kube.kubelet_url == "auto" and not config.loads("{}").kube.kubernetes_labels
