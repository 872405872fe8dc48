"""The deployment files: docker-compose stack, Dockerfile, Kubernetes manifests, and the
configs the local demo generates. No Docker engine, no cluster, no privileges: files are
parsed, cross-checked against each other and the repository, and handed to the real
validators (promtool, amtool, nettap's own config validation, kubectl kustomize when
installed).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exporter import config as nettap_config
from exporter.ingest import settings as ingest_settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
K8S = REPO / "deploy" / "kubernetes"
ALERTS = [REPO / "mixin" / "rendered" / "nettap-alerts.yaml", REPO / "mixin" / "rendered" / "nettap-rules.yaml"]
SERVICES = {"nettap", "nettap-ingest", "nats", "prometheus", "alertmanager", "grafana", "cadvisor", "web", "loadgen"}
# nettap's measured idle footprint (RSS 55-70 MB): the memory request must cover it.
MEASURED_WORKING_SET = 70 << 20
# nettap ingest's measured RSS while forwarding (30-40 MB): its container's request must cover it.
INGEST_MEASURED_WORKING_SET = 40 << 20
BPF_PROBE_PORT = 42424
INGEST_PORT = 42425
INGEST_JOB = "nettap-ingest"        # the mixin's nettapIngestSelector


def _version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not path:
        pytest.fail(f"{name} not installed: run scripts/setup.sh test (make test does)")
    return path


def _run(argv, cwd=None):
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", q)
    assert m, f"unexpected quantity {q!r}"
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30}[m.group(2)]


# ---- docker-compose -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _mounts(service: dict):
    """(host source, container target) of each bind mount of a service (short syntax)."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append((v["source"], v["target"]))
            continue
        parts = v.split(":")
        out.append((parts[0], parts[1]))
    return out


def _repo_mounts(service: dict):
    return [(REPO / src, dst) for src, dst in _mounts(service) if src.startswith(".")]


def test_compose_has_the_stack(compose):
    assert SERVICES <= set(compose["services"])
    named = {src for s in compose["services"].values() for src, _ in _mounts(s)
             if not src.startswith((".", "/"))}
    assert named <= set(compose.get("volumes") or {}), "every named volume is declared"


def test_compose_mounts_exist_in_repo(compose):
    for name, svc in compose["services"].items():
        for src, _ in _repo_mounts(svc):
            assert src.exists(), f"service {name} mounts {src.relative_to(REPO)}, which does not exist"
        build = svc.get("build")
        if build:
            ctx = REPO / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert (ctx / dockerfile).exists()


def test_compose_images_pinned(compose):
    for name, svc in compose["services"].items():
        image = svc.get("image")
        assert image, f"service {name} has no image (an unpinned build?)"
        ref = image.split("/")[-1]
        assert ":" in ref or "@sha256:" in image, f"service {name}: image {image} has no tag"
        tag = ref.split(":", 1)[1] if ":" in ref else ""
        assert tag not in ("latest", "main", "master", "edge"), f"service {name}: image {image} is not pinned"
        assert re.search(r"\d", tag) or "@sha256:" in image, f"service {name}: image {image} is not a version"
    assert compose["services"]["nettap"]["image"] == f"nettap:{_version()}"
    assert compose["services"]["nettap-ingest"]["image"] == compose["services"]["nettap"]["image"]


def test_dockerfile_pinned_and_without_compiler():
    """The image runs without a compiler; its build stage compiles the
    JSON-lines writer and fails when that did not build."""
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(f.startswith("debian:12") and f != "debian:12" and "latest" not in f for f in froms)
    stages = re.split(r"^FROM\s", text, flags=re.M)[1:]
    assert len(stages) == 2

    def installed(stage):
        return " ".join(re.findall(r"apt-get install[^\n]*(?:\\\n[^\n]*)*", stage))
    for pkg in ("python3-venv", "gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"\b{pkg}\b", installed(stages[0])), f"{pkg} not in the build stage"
    assert "from exporter.capture import _jsonl" in stages[0] and "setup.py" in stages[0]
    assert "from exporter.ingest import _split" in stages[0]
    assert "libbpf1" in installed(stages[1])
    for compiler in ("clang", "gcc", "llvm", "build-essential", "libbpf-dev", "python3-dev"):
        assert not re.search(rf"\b{compiler}\b", installed(stages[1])), f"{compiler} in the image"
    # The BPF objects reach the build (setup.py ships them in the package, exporter/bpf),
    # and so does the revision (the context has no .git).
    assert re.search(r"^COPY\s+bpf/\s+\./bpf/", stages[0], re.M), "bpf/*/*.bpf.o not in the build"
    assert re.search(r"^ARG NETTAP_REVISION\b", stages[0], re.M)
    assert list((REPO / "bpf").glob("*/*.bpf.o")), "no committed BPF object to copy"
    ignore = (REPO / ".dockerignore").read_text().split()
    for needed in ("!pyproject.toml", "!setup.py", "!exporter/", "!bpf/*/*.bpf.o"):
        assert needed in ignore


def test_compose_nettap_privileges_and_config(compose):
    svc = compose["services"]["nettap"]
    assert svc["pid"] == "host"
    assert svc.get("privileged") or {"BPF", "PERFMON", "SYS_ADMIN"} <= set(svc["cap_add"])
    targets = {dst for _, dst in _mounts(svc)}
    assert {"/sys/kernel/btf", "/sys/kernel/tracing", "/sys/fs/cgroup"} <= targets
    # The config is read from a mounted repository directory (edits apply live).
    cmd = svc["command"]
    path = cmd[cmd.index("--config") + 1]
    host = [src / Path(path).relative_to(dst) for src, dst in _repo_mounts(svc)
            if path.startswith(dst.rstrip("/") + "/")]
    assert host and host[0].is_file(), f"--config {path} is not in a repository mount"
    cfg = nettap_config.loads(host[0].read_text(), str(host[0]))
    # It captures the workload: the port http.server listens on.
    web_port = int(compose["services"]["web"]["command"][3])
    assert ("port", web_port) in {(t.kind, t.value) for t in cfg.captures}
    assert cfg.bpf_stats_enabled is False
    assert f"web:{web_port}" in " ".join(compose["services"]["loadgen"]["command"])


def _config_file(svc: dict) -> Path:
    """The repository file a service's --config names, through its mounts."""
    cmd = svc["command"]
    path = cmd[cmd.index("--config") + 1]
    host = [src / Path(path).relative_to(dst) for src, dst in _repo_mounts(svc)
            if path.startswith(dst.rstrip("/") + "/")]
    assert host and host[0].is_file(), f"--config {path} is not in a repository mount"
    return host[0]


def test_compose_ingest(compose):
    """nettap ingest: the nettap image's `ingest` command on the capture's config and files,
    without a privilege, publishing to the nats service (JetStream on)."""
    svc, cap = compose["services"]["nettap-ingest"], compose["services"]["nettap"]
    cmd = svc["command"]
    assert cmd[0] == "ingest" and _flag_value(cmd, "--web.listen-address") == f":{INGEST_PORT}"
    cfg_file = _config_file(svc)
    assert cfg_file == _config_file(cap), "ingest reads another config than the capture's"
    cfg = nettap_config.loads(cfg_file.read_text(), str(cfg_file))
    # The capture's files: the same volume, at the same place, writable (the checkpoint).
    out_dir = str(Path(cfg.output.path).parent)
    vols = {dst: src for src, dst in _mounts(svc)}
    assert vols.get(out_dir) == {dst: src for src, dst in _mounts(cap)}.get(out_dir) == "nettap-data"
    assert not [v for v in svc["volumes"] if isinstance(v, str) and v.split(":")[1] == out_dir
                and v.endswith(":ro")]
    # No privilege.
    assert svc["cap_drop"] == ["ALL"] and not svc.get("cap_add") and not svc.get("privileged")
    assert "pid" not in svc and "cgroup" not in svc and svc.get("read_only") is True
    assert "no-new-privileges:true" in svc.get("security_opt", [])
    # The engine: the nats service, JetStream on, reached by its service name.
    s = ingest_settings.parse(cfg.ingest, cfg.output)
    assert s.servers == ("nats://nats:4222",)
    nats = compose["services"]["nats"]
    assert "-js" in nats["command"] and nats["image"].startswith("nats:2.9")
    assert set(svc["depends_on"]) >= {"nats", "nettap"}
    assert f"127.0.0.1:{INGEST_PORT}:{INGEST_PORT}" in svc["ports"]
    res = svc["deploy"]["resources"]
    assert _bytes(res["reservations"]["memory"].replace("M", "Mi")) >= INGEST_MEASURED_WORKING_SET
    check = " ".join(svc["healthcheck"]["test"])
    assert f":{INGEST_PORT}/readyz" in check


def _flag_value(cmd, name):
    return cmd[cmd.index(name) + 1]


def _layout(tmp_path: Path, svc: dict) -> None:
    """Lay out a service's repository mounts under tmp_path as the container sees them."""
    for src, dst in _repo_mounts(svc):
        target = tmp_path / dst.lstrip("/")
        if src.is_dir():
            shutil.copytree(src, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, target)


def _flag(cmd, name):
    for arg in cmd:
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not set in {cmd}")


def test_compose_prometheus_config_promtool(compose, tmp_path):
    promtool = _tool("promtool")
    svc = compose["services"]["prometheus"]
    _layout(tmp_path, svc)
    cfg_path = tmp_path / _flag(svc["command"], "--config.file").lstrip("/")
    assert cfg_path.exists(), "--config.file is not a mounted file"
    out = _run([promtool, "check", "config", cfg_path])
    assert "SUCCESS" in out
    cfg = yaml.safe_load(cfg_path.read_text())
    # Every rendered rule file is loaded, as mounted.
    loaded = {(cfg_path.parent / r).resolve() for r in cfg["rule_files"]}
    mounted = {(tmp_path / dst.lstrip("/")).resolve(): src for src, dst in _repo_mounts(svc)}
    assert {mounted[p] for p in loaded if p in mounted} == set(ALERTS)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert {"nettap", "cadvisor", "prometheus"} <= set(jobs)
    targets = [t for sc in jobs["nettap"]["static_configs"] for t in sc["targets"]]
    assert targets == [f"nettap:{BPF_PROBE_PORT}"]
    targets = [t for sc in jobs[INGEST_JOB]["static_configs"] for t in sc["targets"]]
    assert targets == [f"nettap-ingest:{INGEST_PORT}"]
    am = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"] and "alertmanager" in compose["services"]


def test_compose_alertmanager_config_amtool(compose, tmp_path):
    amtool = _tool("amtool")
    svc = compose["services"]["alertmanager"]
    _layout(tmp_path, svc)
    cfg_path = tmp_path / _flag(svc["command"], "--config.file").lstrip("/")
    assert cfg_path.exists()
    assert "SUCCESS" in _run([amtool, "check-config", cfg_path])


def _dashboard_datasource_refs(obj):
    if isinstance(obj, dict):
        if "datasource" in obj and isinstance(obj["datasource"], dict):
            yield obj["datasource"]
        for v in obj.values():
            yield from _dashboard_datasource_refs(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _dashboard_datasource_refs(v)


def test_compose_grafana_provisioning(compose):
    svc = compose["services"]["grafana"]
    mounts = {dst: src for src, dst in _repo_mounts(svc)}
    prov = mounts["/etc/grafana/provisioning"]
    datasources = [d for f in (prov / "datasources").glob("*.yaml")
                   for d in yaml.safe_load(f.read_text())["datasources"]]
    prom = [d for d in datasources if d["type"] == "prometheus"]
    assert len(prom) == 1 and prom[0]["isDefault"] and prom[0]["uid"]
    assert prom[0]["url"] == "http://prometheus:9090"
    uids = {d["uid"] for d in datasources}

    providers = [p for f in (prov / "dashboards").glob("*.yaml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers
    files = []
    for p in providers:
        path = p["options"]["path"]
        assert path in mounts, f"dashboard provider path {path} is not mounted"
        files += sorted(mounts[path].glob("*.json"))
    names = {f.name for f in files}
    assert {"nettap-overview.json", "nettap-bpf-programs.json", "nettap-sizing.json"} <= names
    home = svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert any(home.startswith(p["options"]["path"] + "/") and Path(home).name in names for p in providers)
    assert svc["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert svc["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"

    # Every panel and variable reaches the provisioned Prometheus: through the
    # dashboard's datasource variable (type prometheus: the default one), or by uid.
    for f in files:
        d = json.loads(f.read_text())
        variables = {v["name"]: v for v in d.get("templating", {}).get("list", []) if v["type"] == "datasource"}
        for ref in _dashboard_datasource_refs(d):
            uid = ref.get("uid", "")
            m = re.fullmatch(r"\$\{?(\w+)\}?", uid)
            if m:
                var = variables.get(m.group(1))
                assert var and var["query"] == "prometheus", f"{f.name}: datasource {uid} is not a prometheus variable"
            else:
                assert uid in uids, f"{f.name}: datasource uid {uid!r} is not provisioned"


# ---- Kubernetes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifests():
    docs = {}
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def _one(manifests, kind):
    assert len(manifests.get(kind, [])) == 1, f"expected one {kind}"
    return manifests[kind][0]


def test_kustomization_lists_every_file():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files
    assert len(k["resources"]) == len(set(k["resources"]))
    assert k["images"][0]["newTag"] == _version()


def test_kustomize_builds():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed")
    out = _run([kubectl, "kustomize", str(K8S)])
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == sorted(["Namespace", "ConfigMap", "DaemonSet", "Service", "PodMonitor", "PodMonitor",
                            "PrometheusRule"])


def test_manifests_in_namespace(manifests):
    ns = _one(manifests, "Namespace")["metadata"]["name"]
    for kind, docs in manifests.items():
        for d in docs:
            if kind not in ("Namespace", "Kustomization"):
                assert d["metadata"]["namespace"] == ns, f"{kind} {d['metadata']['name']}"


def test_prometheusrule_is_the_mixin(manifests):
    _run([sys.executable, str(K8S / "render.py"), "--check"])
    rule = _one(manifests, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    expected = [g for f in ALERTS for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == expected


def test_prometheusrule_promtool(manifests, tmp_path):
    promtool = _tool("promtool")
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": _one(manifests, "PrometheusRule")["spec"]["groups"]}))
    assert "SUCCESS" in _run([promtool, "check", "rules", f])


def test_configmap_config_is_valid(manifests):
    cm = _one(manifests, "ConfigMap")
    assert set(cm["data"]) == {"nettap.yaml"}
    cfg = nettap_config.loads(cm["data"]["nettap.yaml"], "configmap nettap.yaml")
    assert cfg.bpf_stats_enabled is False
    # nettap ingest's section, as ingest checks it: files it can follow, a cluster's stream.
    s = ingest_settings.parse(cfg.ingest, cfg.output)
    assert s.stream.replicas == 3
    assert s.checkpoint == ingest_settings.default_checkpoint(cfg.output.path)


def _containers(pod: dict) -> dict:
    return {c["name"]: c for c in pod["containers"]}


def _relabel(labels: dict, rules: list) -> dict:
    """Prometheus' relabeling, the replace action only (the default), as a PodMonitor writes it."""
    out = dict(labels)
    for r in rules:
        assert r.get("action", "replace") == "replace", r
        value = r.get("separator", ";").join(out.get(s, "") for s in r.get("sourceLabels", []))
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        if m:
            out[r["targetLabel"]] = m.expand(r.get("replacement", "$1").replace("$", "\\"))
    return out


def test_daemonset(manifests):
    ds = _one(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["hostPID"] is True
    assert set(_containers(pod)) == {"nettap", "nettap-ingest"}
    c = _containers(pod)["nettap"]
    assert c["image"].endswith(":" + _version())
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port == {"metrics": BPF_PROBE_PORT}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

    caps = set(c["securityContext"].get("capabilities", {}).get("add", []))
    assert c["securityContext"].get("privileged") or {"BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"} <= caps

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    host = {volumes[m["name"]]["hostPath"]["path"]: m for m in c["volumeMounts"] if "hostPath" in volumes[m["name"]]}
    for path in ("/sys/kernel/btf", "/sys/kernel/tracing", "/sys/fs/cgroup", "/var/run/netns"):
        assert path in host, f"{path} not mounted from the host"
    assert host["/var/run/netns"]["mountPropagation"] == "HostToContainer"

    # Config: the ConfigMap as a directory (no subPath: updates reach the pod live),
    # and --config names its key in it.
    cm = _one(manifests, "ConfigMap")
    (cfg_mount,) = [m for m in c["volumeMounts"] if "configMap" in volumes[m["name"]]]
    assert "subPath" not in cfg_mount
    assert volumes[cfg_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    args = c["args"]
    path = Path(args[args.index("--config") + 1])
    assert str(path.parent) == cfg_mount["mountPath"] and path.name in cm["data"]
    assert mounts[cfg_mount["mountPath"]]["readOnly"] is True

    # Sizing: the memory request covers the measured working set (the seed's lesson),
    # and the limit leaves room above the request.
    res = c["resources"]
    req, lim = _bytes(res["requests"]["memory"]), _bytes(res["limits"]["memory"])
    assert MEASURED_WORKING_SET <= req < lim
    assert res["requests"]["cpu"] and res["limits"]["cpu"]


def test_daemonset_ingest(manifests):
    """The second container: `nettap ingest` on the capture's config and files, with its own
    probes and sizing, no privilege, not root, and able to read what the capture writes."""
    ds = _one(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    cap, ing = _containers(pod)["nettap"], _containers(pod)["nettap-ingest"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert ing["image"] == cap["image"]
    args = ing["args"]
    assert args[0] == "ingest"
    assert _flag_value(args, "--config") == _flag_value(cap["args"], "--config")
    assert _flag_value(args, "--web.listen-address") == f":{INGEST_PORT}"
    assert {p["name"]: p["containerPort"] for p in ing["ports"]} == {"ingest-metrics": INGEST_PORT}
    names = [p["name"] for c in pod["containers"] for p in c["ports"]]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)
    # Neither restarted nor NotReady for being away from the engine (a NotReady pod stalls the
    # DaemonSet's rollouts): /healthz both; the alert tells of the engine.
    assert ing["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "ingest-metrics"}
    assert ing["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "ingest-metrics"}
    env = {e["name"]: e for e in ing["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    res = ing["resources"]
    req, lim = _bytes(res["requests"]["memory"]), _bytes(res["limits"]["memory"])
    assert INGEST_MEASURED_WORKING_SET <= req < lim
    assert res["requests"]["cpu"] and res["limits"]["cpu"]

    sc = ing["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert not sc.get("privileged")

    # The same config (the ConfigMap's directory), and the capture's files: the same hostPath
    # volume at the same place, writable (the checkpoint beside them).
    cm = _one(manifests, "ConfigMap")
    cfg = nettap_config.loads(cm["data"]["nettap.yaml"])
    out_dir = str(Path(cfg.output.path).parent)
    checkpoint_dir = str(Path(ingest_settings.parse(cfg.ingest, cfg.output).checkpoint).parent)

    def mount(c, path):
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
        return m
    for path in (out_dir, checkpoint_dir):
        assert mount(ing, path)["name"] == mount(cap, path)["name"]
        assert "hostPath" in volumes[mount(ing, path)["name"]] and not mount(ing, path).get("readOnly")
    assert not mount(cap, out_dir).get("readOnly")
    config_dir = str(Path(_flag_value(args, "--config")).parent)
    assert volumes[mount(ing, config_dir)["name"]]["configMap"]["name"] == cm["metadata"]["name"]

    # It reads the capture's files through their group: the capture (root) writes them with
    # group read, and the init container gives the directory (setgid: and so every file made in
    # it) the ingest's group, being root in that group, without any capability.
    assert cfg.output.mode & 0o040, f"output.mode {cfg.output.mode:04o}: the ingest's group cannot read"
    (init,) = pod["initContainers"]
    assert mount(init, out_dir)["name"] == mount(cap, out_dir)["name"]
    script = init["command"][-1]
    gid = sc["runAsGroup"]
    assert re.search(rf"^chgrp {gid} \"\$d\"$", script, re.M) and re.search(r"^chmod 3770 \"\$d\"$", script, re.M)
    assert re.search(rf"^d={re.escape(out_dir)}$", script, re.M)
    isc = init["securityContext"]
    assert isc["runAsUser"] == 0 and isc["runAsGroup"] == gid and isc["capabilities"] == {"drop": ["ALL"]}
    assert isc["allowPrivilegeEscalation"] is False

    # The engine's password, when it asks for one: an optional Secret, where the ConfigMap's
    # (commented) password_file points.
    (secret_mount,) = [m for m in ing["volumeMounts"] if "secret" in volumes[m["name"]]]
    secret = volumes[secret_mount["name"]]["secret"]
    assert secret["optional"] is True and secret_mount["readOnly"] is True
    pw = re.search(r"^\s*#\s*password_file: (\S+)$", cm["data"]["nettap.yaml"], re.M)
    assert pw and str(Path(pw.group(1)).parent) == secret_mount["mountPath"]
    assert not [m for m in cap["volumeMounts"] if m["name"] == secret_mount["name"]], "the capture mounts the secret"


def test_service_and_podmonitor_select_the_pods(manifests):
    ds = _one(manifests, "DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    svc = _one(manifests, "Service")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["metrics", "ingest-metrics"]
    pms = {pm["metadata"]["name"]: pm for pm in manifests["PodMonitor"]}
    assert set(pms) == {"nettap", "nettap-ingest"}
    for pm in pms.values():
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pm = pms["nettap"]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    # The mixin selects job="nettap": the job label comes from this pod label.
    assert labels[pm["spec"]["jobLabel"]] == "nettap"
    assert 'job="nettap"' in (REPO / "mixin" / "rendered" / "nettap-alerts.yaml").read_text()
    # The ingest: its own port and job="nettap-ingest" (the mixin's nettapIngestSelector), set by
    # relabeling over the operator's default job name (<namespace>/<PodMonitor name>).
    pm = pms["nettap-ingest"]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "ingest-metrics" and "jobLabel" not in pm["spec"]
    after = _relabel({"job": "nettap/nettap-ingest", "__meta_kubernetes_pod_node_name": "node-1"}, ep["relabelings"])
    assert after["job"] == INGEST_JOB and after["node"] == "node-1"
    assert f"nettapIngestSelector: 'job=\"{INGEST_JOB}\"'" in (REPO / "mixin" / "config.libsonnet").read_text()
    assert f'job="{INGEST_JOB}"' in (REPO / "mixin" / "rendered" / "nettap-alerts.yaml").read_text()


# ---- the local demo's generated configs ---------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return _load_module("nettap_demo", REPO / "scripts" / "demo.py")


def test_demo_prometheus_config(demo, tmp_path):
    promtool = _tool("promtool")
    f = tmp_path / "prometheus.yml"
    f.write_text(demo.prometheus_config(42424, 42425, 9090, 9093))
    assert "SUCCESS" in _run([promtool, "check", "config", f])
    cfg = yaml.safe_load(f.read_text())
    assert [Path(r) for r in cfg["rule_files"]] == ALERTS
    assert cfg["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in cfg["scrape_configs"]}
    assert {"nettap", "prometheus"} <= set(jobs)
    assert jobs["nettap"] == ["127.0.0.1:42424"] and jobs[INGEST_JOB] == ["127.0.0.1:42425"]


def test_demo_alertmanager_config(demo, tmp_path):
    amtool = _tool("amtool")
    f = tmp_path / "alertmanager.yml"
    f.write_text(demo.alertmanager_config())
    assert "SUCCESS" in _run([amtool, "check-config", f])


def test_demo_nettap_config(demo):
    cfg = nettap_config.loads(demo.nettap_config("/var/run/netns/nettap-demo", "/tmp/x/capture.jsonl",
                                                 "nats://127.0.0.1:4222"))
    assert [(t.kind, t.value) for t in cfg.captures] == [("netns", "/var/run/netns/nettap-demo")]
    assert ingest_settings.parse(cfg.ingest, cfg.output).servers == ("nats://127.0.0.1:4222",)


def test_demo_refuses_without_root(tmp_path):
    if subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() == "0":
        p = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py"), "--help"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and "--duration" in p.stdout
        return
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py"), "--duration", "1"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "needs root" in p.stderr


def test_loadgen_fixed_rate():
    """The workload's load generator (compose and demo) keeps its rate."""
    import http.server
    import threading
    import time

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(time.monotonic())
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        p = subprocess.run([sys.executable, str(REPO / "deploy" / "compose" / "loadgen.py"),
                            "--url", f"http://127.0.0.1:{srv.server_address[1]}/", "--rate", "40",
                            "--duration", "1.5", "--report", "0"], capture_output=True, text=True, timeout=30)
    finally:
        srv.shutdown()
        srv.server_close()
    assert p.returncode == 0, p.stderr
    # 60 due; never more (no bursts), a few less on a busy machine.
    assert 45 <= len(hits) <= 61, f"{len(hits)} requests in 1.5s at 40/s"
