"""The Helm chart (deploy/helm/nettap), rendered, validated and linted by Helm's own engine:
helm-python-sdk loads Helm v4 as a library (no helm binary, no cluster). Its objects are compared
with what `kubectl kustomize deploy/kubernetes` renders, so the two never drift; the resource
document's own values snippets (shared/seeds/000) go in as written; the rendered config is
checked by `nettap --check-config`."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exporter import config as nettap_config
from exporter.commands import size
from exporter.ingest import settings as ingest_settings

if sys.version_info < (3, 10):
    pytest.skip("helm-python-sdk needs Python 3.10 or later", allow_module_level=True)
import helm_python as helm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "nettap"
K8S = REPO / "deploy" / "kubernetes"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

# The resource document's two Helm snippets ("Sizing the Collector", "Measuring eBPF Kernel
# Time"), as written there; its text lost their indentation, which YAML's nesting restores.
DOC_RESOURCES = """\
ebpf:
  enabled: true
  nettap:
    resources:
      requests:
        cpu: "250m"
        memory: "512Mi"
      limits:
        cpu: "750m"
        memory: "1Gi"
"""
DOC_BPFSTATS = """\
ebpf:
  configuration:
    diagnostics:
      bpfStats:
        enabled: true
"""


def test_the_snippets_are_the_documents():
    """Line for line the document's (when it is at hand: shared/seeds beside the checkout)."""
    seeds = [p for d in REPO.parents for p in sorted((d / "shared" / "seeds").glob("000_*.txt"))]
    if not seeds:
        pytest.skip("the resource document (shared/seeds/000_*.txt) is not beside this checkout")
    lines = [x.strip() for x in seeds[0].read_text().splitlines()]
    for snippet in (DOC_RESOURCES, DOC_BPFSTATS):
        want = [x.strip() for x in snippet.splitlines()]
        assert any(lines[i:i + len(want)] == want for i in range(len(lines))), snippet


@pytest.fixture(scope="module")
def chart():
    c = helm.Chart.load(CHART)
    yield c
    c.close()


def render(chart, values=None, name="nettap", namespace="nettap") -> dict:
    """{(kind, name): object} of what Helm renders (NOTES.txt aside)."""
    docs = {}
    for path, text in chart.render(values or {}, name=name, namespace=namespace).items():
        if not path.endswith("NOTES.txt"):
            for d in yaml.safe_load_all(text):
                if d:
                    docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


def pod(docs) -> dict:
    return docs[("DaemonSet", "nettap")]["spec"]["template"]["spec"]


def containers(docs) -> dict:
    return {c["name"]: c for c in pod(docs)["containers"]}


def nettap_yaml(docs) -> str:
    return docs[("ConfigMap", "nettap-config")]["data"]["nettap.yaml"]


@pytest.fixture(scope="module")
def kustomize() -> dict:
    """What `kubectl kustomize deploy/kubernetes` renders; without kubectl, the files as written
    (the kustomization sets only the namespace and the image's tag, which they carry already)."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        text = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, check=True,
                              timeout=60).stdout
    else:
        k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
        text = "\n---\n".join((K8S / f).read_text() for f in k["resources"])
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def _without_selector(spec: dict, key: str) -> tuple:
    spec = copy.deepcopy(spec)
    labels = spec.pop("selector")
    return spec, labels.get(key, labels)


def test_default_daemonset_is_the_kustomize_one(chart, kustomize):
    """The pod, field for field: containers, args, ports, probes, env, capabilities, mounts,
    resources, the init container, volumes, host PID, tolerations; the chart's selector is
    the kustomize one plus the release's instance."""
    ds, want = render(chart)[("DaemonSet", "nettap")], kustomize[("DaemonSet", "nettap")]
    assert ds["metadata"]["namespace"] == want["metadata"]["namespace"]
    assert ds["spec"]["template"]["spec"] == want["spec"]["template"]["spec"]
    spec, selector = _without_selector(ds["spec"], "matchLabels")
    want_spec, want_selector = _without_selector(want["spec"], "matchLabels")
    assert want_selector.items() <= selector.items() and selector["app.kubernetes.io/instance"] == "nettap"
    del spec["template"], want_spec["template"]
    assert spec == want_spec                                    # the update strategy
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert want["spec"]["template"]["metadata"]["labels"].items() <= labels.items()
    assert selector.items() <= labels.items()


def test_with_monitoring_every_object_is_the_kustomize_ones(chart, kustomize):
    """The Service, both PodMonitors and the PrometheusRule (the mixin's groups), and the
    ConfigMap's config as nettap and nettap ingest read it; the chart leaves the namespace to
    Helm (--create-namespace)."""
    docs = render(chart, {"monitoring": {"enabled": True}})
    assert set(docs) == set(kustomize) - {("Namespace", "nettap")}
    for key in (("Service", "nettap"), ("PodMonitor", "nettap"), ("PodMonitor", "nettap-ingest")):
        spec, selector = _without_selector(docs[key]["spec"], "matchLabels")
        want, want_selector = _without_selector(kustomize[key]["spec"], "matchLabels")
        assert spec == want, key
        assert want_selector.items() <= selector.items(), key
    assert docs[("PrometheusRule", "nettap")]["spec"] == kustomize[("PrometheusRule", "nettap")]["spec"]
    ours, theirs = nettap_yaml(docs), kustomize[("ConfigMap", "nettap-config")]["data"]["nettap.yaml"]
    assert nettap_config.loads(ours) == nettap_config.loads(theirs)
    mine, want = nettap_config.loads(ours), nettap_config.loads(theirs)
    assert ingest_settings.parse(mine.ingest, mine.output) == ingest_settings.parse(want.ingest, want.output)
    for key, d in docs.items():
        assert d["metadata"].get("namespace") == "nettap", key


def test_the_documents_resources_block_sizes_both_containers(chart):
    """Its one block of requests and limits lands on the capture and the ingest."""
    want = yaml.safe_load(DOC_RESOURCES)["ebpf"]["nettap"]["resources"]
    c = containers(render(chart, yaml.safe_load(DOC_RESOURCES)))
    assert c["nettap"]["resources"] == c["nettap-ingest"]["resources"] == want


def test_the_documents_bpfstats_block_applies_without_a_restart(chart):
    """It turns bpfStats on in the ConfigMap nettap watches, and leaves the DaemonSet as it was:
    no pod restarts (the pod template carries no checksum of it). What nettap ingest reads at
    start only does roll the pods."""
    before, after = render(chart), render(chart, yaml.safe_load(DOC_BPFSTATS))
    cfg = yaml.safe_load(nettap_yaml(after))
    assert cfg["diagnostics"]["bpfStats"] == {"enabled": True, "scope": "own"}
    assert nettap_config.loads(nettap_yaml(after)).bpf_stats_enabled is True
    assert nettap_config.loads(nettap_yaml(before)).bpf_stats_enabled is False
    del cfg["diagnostics"]["bpfStats"]["enabled"]
    plain = yaml.safe_load(nettap_yaml(before))
    del plain["diagnostics"]["bpfStats"]["enabled"]
    assert cfg == plain                                        # nothing else changed
    assert after[("DaemonSet", "nettap")] == before[("DaemonSet", "nettap")]
    moved = render(chart, {"ingest": {"servers": ["nats://engine.example:4222"]}})
    assert moved[("DaemonSet", "nettap")]["spec"]["template"] != before[("DaemonSet", "nettap")]["spec"]["template"]


def test_ingest_disabled_is_metrics_only_without_nats(chart):
    """No ingest container, no init container or node directory for its files, no NATS setting
    anywhere; the capture keeps no payload, and the config is one nettap takes."""
    values = {"ingest": {"enabled": False}, "monitoring": {"enabled": True}}
    docs = render(chart, values)
    assert set(containers(docs)) == {"nettap"}
    assert "initContainers" not in pod(docs)
    assert {v["name"] for v in pod(docs)["volumes"]} == {"config", "btf", "tracefs", "cgroup", "netns"}
    cfg = yaml.safe_load(nettap_yaml(docs))
    assert "ingest" not in cfg and cfg["output"] == {"type": "none"}
    assert nettap_config.loads(nettap_yaml(docs)).output.type == "none"
    text = yaml.safe_dump_all(list(docs.values())).lower()
    assert "nats" not in text, [line for line in text.splitlines() if "nats" in line]
    assert [p["name"] for p in docs[("Service", "nettap")]["spec"]["ports"]] == ["metrics"]
    assert [k for k in docs if k[0] == "PodMonitor"] == [("PodMonitor", "nettap")]
    mixin = [g["name"] for f in ("nettap-alerts.yaml", "nettap-rules.yaml")
             for g in yaml.safe_load((REPO / "mixin" / "rendered" / f).read_text())["groups"]]
    assert [g["name"] for g in docs[("PrometheusRule", "nettap")]["spec"]["groups"]] == \
        [g for g in mixin if g != "nettap-ingest"]
    assert "annotations" not in docs[("DaemonSet", "nettap")]["spec"]["template"]["metadata"]


def test_per_container_resources_win_over_the_one_block(chart):
    doc = yaml.safe_load(DOC_RESOURCES)["ebpf"]["nettap"]["resources"]
    small = {"requests": {"cpu": "20m", "memory": "48Mi"}, "limits": {"cpu": "200m", "memory": "96Mi"}}
    values = yaml.safe_load(DOC_RESOURCES)
    c = containers(render(chart, {**values, "capture": {"resources": small}}))
    assert c["nettap"]["resources"] == small and c["nettap-ingest"]["resources"] == doc
    c = containers(render(chart, {**values, "ingest": {"resources": small}}))
    assert c["nettap"]["resources"] == doc and c["nettap-ingest"]["resources"] == small
    # Neither set: each container's own measured default (the kustomize DaemonSet's).
    defaults = chart.values
    c = containers(render(chart))
    assert c["nettap"]["resources"] == defaults["capture"]["defaultResources"]
    assert c["nettap-ingest"]["resources"] == defaults["ingest"]["defaultResources"]
    assert c["nettap"]["resources"] != c["nettap-ingest"]["resources"]


@pytest.mark.parametrize("values, message", [
    ({"ebpf": {"nettap": {"resource": {}}}}, "at '/ebpf/nettap': additional properties 'resource' not allowed"),
    ({"ebpf": {"configuration": {"diagnostics": {"bpfstats": {"enabled": True}}}}},
     "at '/ebpf/configuration/diagnostics': additional properties 'bpfstats' not allowed"),
    ({"ingest": {"enable": False}}, "at '/ingest': additional properties 'enable' not allowed"),
    ({"ebpf": {"enabled": "yes"}}, "at '/ebpf/enabled': got string, want boolean"),
    ({"ingest": {"servers": "nats://nats:4222"}}, "at '/ingest/servers': got string, want array"),
    ({"capture": {"resources": {"limits": {"memory": "1 GB"}}}}, "at '/capture/resources/limits/memory'"),
    ({"ebpf": {"configuration": {"capture": {"max_payload_bytes": "4k"}}}},
     "at '/ebpf/configuration/capture/max_payload_bytes': got string, want integer"),
    ({"ebpf": {"configuration": {"log_level": "verbose"}}}, "at '/ebpf/configuration/log_level'"),
    ({"ebpf": {"configuration": {"ingest": {"servers": ["nats://a:4222"]}}}},
     "at '/ebpf/configuration/ingest': additional properties 'servers' not allowed"),
])
def test_the_schema_refuses_a_misspelt_key_or_a_wrong_type(chart, values, message):
    """At install (Helm validates before rendering), naming the key's path."""
    with pytest.raises(helm.HelmValuesError) as e:
        chart.render(values, name="nettap", namespace="nettap")
    assert message in str(e.value), str(e.value)
    assert "values don't meet the specifications of the schema" in str(e.value)


@pytest.mark.parametrize("values", [{}, {"monitoring": {"enabled": True}},
                                    {"ingest": {"enabled": False}, "monitoring": {"enabled": True}},
                                    {"kubernetes": {"enabled": True}}])
def test_lint_is_clean(values):
    """helm lint --strict: no warning, no error (its one note: the chart has no icon)."""
    report = helm.lint(CHART, values, strict=True, namespace="nettap")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("ingest,kube", [(True, False), (False, False), (True, True)])
def test_the_rendered_config_passes_check_config(chart, ingest, kube, tmp_path):
    """nettap --check-config on the ConfigMap's file, its node directory moved under tmp_path (the
    check makes the output's directory as the daemon would); nettap ingest's section as ingest
    parses it."""
    text = nettap_yaml(render(chart, {"ingest": {"enabled": ingest}, "kubernetes": {"enabled": kube}}))
    assert nettap_config.loads(text).kube.kubelet_url == ("auto" if kube else "off")
    cfg = yaml.safe_load(text)
    if ingest:
        s = ingest_settings.parse(cfg["ingest"], nettap_config.loads(text).output)
        assert s.servers == ("nats://nats.nats.svc:4222",) and s.stream.replicas == 3
        root = tmp_path / "node"
        cfg["output"]["path"] = str(root / Path(cfg["output"]["path"]).relative_to("/var/lib/nettap"))
        cfg["output"]["root"] = str(root)
    f = tmp_path / "nettap.yaml"
    f.write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "exporter", "--check-config", "--config", str(f)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"{f}: ok", p.stderr


def test_size_helm_output_renders_onto_each_container(chart):
    """`nettap size -o helm`'s values, given as they are (-f), size each container from its own
    figures, over the document's one block."""
    mib = size.MiB
    nodes = [size.Node("a:42424", rss_peak=90 * mib, cpu={"p95": 0.12, "max": 0.3}, periods=10, throttled_periods=0),
             size.Node("a:42425", rss_peak=36 * mib, cpu={"p95": 0.03, "max": 0.05}, role=size.INGEST)]
    out = size.helm_values(nodes, "http://prometheus:9090", 1796137200, "7d")
    assert f"```yaml\n{out}```" in (REPO / "docs" / "operator-tools.md").read_text()     # the docs' example
    values = yaml.safe_load(out)
    c = containers(render(chart, {**yaml.safe_load(DOC_RESOURCES), **values}))
    assert c["nettap"]["resources"] == {"requests": {"cpu": "120m", "memory": "128Mi"},
                                        "limits": {"cpu": "600m", "memory": "256Mi"}}
    assert c["nettap-ingest"]["resources"] == {"requests": {"cpu": "30m", "memory": "48Mi"},
                                               "limits": {"cpu": "100m", "memory": "96Mi"}}


def test_ebpf_disabled_renders_nothing(chart):
    out = chart.render({"ebpf": {"enabled": False}, "monitoring": {"enabled": True}}, name="nettap",
                       namespace="nettap")
    assert not [path for path, text in out.items() if text.strip()]


def test_placement_image_and_extra_values_land(chart):
    values = {"image": {"repository": "registry.example/nettap", "tag": "0.1.0-rc1", "pullPolicy": "Always",
                        "pullSecrets": [{"name": "regcred"}]},
              "nodeSelector": {"kubernetes.io/os": "linux"}, "tolerations": [{"key": "a", "operator": "Exists"}],
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["web"]}]}]}}},
              "priorityClassName": "system-node-critical", "podAnnotations": {"team": "net"},
              "extraArgs": ["--log.level", "debug"], "monitoring": {"enabled": True, "labels": {"release": "kps"}}}
    docs = render(chart, values, name="edge", namespace="obs")
    ds = docs[("DaemonSet", "edge-nettap")]
    p = ds["spec"]["template"]["spec"]
    for c in p["containers"] + p["initContainers"]:
        assert c["image"] == "registry.example/nettap:0.1.0-rc1" and c["imagePullPolicy"] == "Always"
    assert p["imagePullSecrets"] == [{"name": "regcred"}] and p["nodeSelector"] == values["nodeSelector"]
    assert p["tolerations"] == values["tolerations"] and p["affinity"] == values["affinity"]
    assert p["priorityClassName"] == "system-node-critical"
    assert ds["spec"]["template"]["metadata"]["annotations"]["team"] == "net"
    c = {c["name"]: c for c in p["containers"]}
    assert c["nettap"]["args"][-2:] == ["--log.level", "debug"] and c["nettap-ingest"]["args"][0] == "ingest"
    # Named after the release, in its namespace; the config is the release's own ConfigMap.
    assert {v["name"]: v for v in p["volumes"]}["config"]["configMap"]["name"] == "edge-nettap-config"
    assert {v["name"]: v for v in p["volumes"]}["nats"]["secret"]["secretName"] == "edge-nettap-nats"
    assert ("ConfigMap", "edge-nettap-config") in docs
    assert all(d["metadata"]["namespace"] == "obs" for d in docs.values())
    for kind in ("PodMonitor", "PrometheusRule"):
        assert all(d["metadata"]["labels"]["release"] == "kps" for k, d in docs.items() if k[0] == kind)
    # A node agent tolerates every taint by default.
    assert pod(render(chart))["tolerations"] == [{"operator": "Exists"}]


def test_chart_version_is_nettaps(chart):
    version = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert chart.metadata["appVersion"] == version and chart.metadata["apiVersion"] == "v2"
    assert chart.values["image"]["tag"] == ""                   # the appVersion


def _owned_keys(values: dict, schema: dict, defs: dict, prefix: str = "") -> list:
    """Dotted keys of values.yaml down to what the chart owns: into an object the schema spells
    out (properties), not into a Kubernetes type or nettap's config (a $ref)."""
    out = []
    for k, v in values.items():
        sub = schema.get("properties", {}).get(k, {})
        if isinstance(v, dict) and v and "properties" in sub and "$ref" not in sub:
            out += _owned_keys(v, sub, defs, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return out


def test_every_value_is_documented(chart):
    """docs/deploy.md's table of values lists every key of values.yaml, and no other."""
    keys = _owned_keys(chart.values, chart.schema, chart.schema["definitions"])
    assert "ebpf.configuration" in keys and "capture.defaultResources" in keys and "image.tag" in keys
    text = DEPLOY_DOC.read_text()
    start = text.index("### Helm values\n")
    table = text[start:text.index("\n### ", start + 1)]
    documented = re.findall(r"^\| `([A-Za-z.]+)` \|", table, re.M)
    assert sorted(documented) == sorted(keys)


def test_the_sizing_tiers_in_values_are_the_runbooks():
    """values.yaml's comment gives docs/runbook.md's starting points, row for row."""
    runbook = (REPO / "docs" / "runbook.md").read_text()
    sizing = runbook[runbook.index("## Sizing nettap"):]
    want = [[c.strip() for c in row] for row in re.findall(
        r"^\| ((?:Up to|~)[^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|", sizing, re.M)]
    rows = re.findall(r"^    #   ((?:Up to |~)\S.*?)\s{2,}(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$",
                      (CHART / "values.yaml").read_text(), re.M)
    assert len(want) == 3 and [list(r) for r in rows] == want


def test_kubernetes_enabled_gives_the_capture_alone_its_kubelet_access(chart):
    """kubernetes.enabled: a ServiceAccount bound to get nodes/pods (the kubelet's /pods) and
    nothing else, nodes/proxy only where asked (older kubelets); its token and the cluster's CA
    mounted in the capture container only, with NODE_IP and NODE_NAME for kubelet_url auto; the
    kubelet's certificate not checked unless asked. Off (the default): none of it, and the
    config's kubelet_url off."""
    off = render(chart)
    assert not [k for k in off if k[0] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    assert "serviceAccountName" not in pod(off) and pod(off)["automountServiceAccountToken"] is False
    assert yaml.safe_load(nettap_yaml(off))["kubernetes"] == {"kubelet_url": "off"}
    on = render(chart, {"kubernetes": {"enabled": True}})
    role, binding = on[("ClusterRole", "nettap-kubelet-pods")], on[("ClusterRoleBinding", "nettap-kubelet-pods")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/pods"], "verbs": ["get"]}]
    proxy = render(chart, {"kubernetes": {"enabled": True, "nodesProxy": True}})
    assert proxy[("ClusterRole", "nettap-kubelet-pods")]["rules"][0]["resources"] == ["nodes/pods", "nodes/proxy"]
    assert binding["roleRef"]["name"] == "nettap-kubelet-pods"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "nettap", "namespace": "nettap"}]
    assert on[("ServiceAccount", "nettap")]["automountServiceAccountToken"] is False
    spec = pod(on)
    assert spec["serviceAccountName"] == "nettap" and spec["automountServiceAccountToken"] is False
    c = containers(on)
    mounts = {n: {m["mountPath"]: m["name"] for m in c[n].get("volumeMounts", [])} for n in c}
    assert mounts["nettap"]["/var/run/secrets/kubernetes.io/serviceaccount"] == "kube-api-access"
    assert "kube-api-access" not in mounts["nettap-ingest"].values()
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["nettap"]["env"]} == \
        {"NODE_IP": "status.hostIP", "NODE_NAME": "spec.nodeName"}
    vol = {v["name"]: v for v in spec["volumes"]}["kube-api-access"]["projected"]["sources"]
    assert vol[0]["serviceAccountToken"]["path"] == "token" and vol[1]["configMap"]["name"] == "kube-root-ca.crt"
    kube = nettap_config.loads(nettap_yaml(on)).kube
    assert kube.kubelet_url == "auto" and kube.insecure_skip_verify is True
    assert kube.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    strict = render(chart, {"kubernetes": {"enabled": True, "insecureSkipVerify": False}})
    assert nettap_config.loads(nettap_yaml(strict)).kube.insecure_skip_verify is False
