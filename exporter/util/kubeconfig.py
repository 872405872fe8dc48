"""The config file's Kubernetes parts: a ``captures`` item ``kubernetes:`` (a
selector of the node's pods), the ``kubernetes:`` section (where the kubelet
is, how often it is asked) and the ``metrics:`` section. exporter/config.py
parses the file and calls these; exporter/capture/kube.py acts on them.
"""
from __future__ import annotations

import fnmatch
import re
from collections import namedtuple

from exporter.util.schema import Bool, Check, ConfigError, Int, Key, Section, Str, quote

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
# A name as the API allows it (a DNS label or subdomain; a pod name glob adds * ? [ ])
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_GLOB = re.compile(r"^[-a-z0-9.*?\[\]!]+$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# What the API server admits (k8s.io/apimachinery validation): a namespace and a
# container's name are DNS-1123 labels, a pod's name a DNS-1123 subdomain
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def pod_names_valid(namespace: str, name: str, labels: dict, containers) -> bool:
    """Whether a pod's names, labels and containers' names are as the API
    server admits them (a kubelet's answer is checked before its names go
    into lines and label values)."""
    return (bool(_DNS_LABEL.match(namespace)) and len(name) <= 253 and bool(_DNS_SUBDOMAIN.match(name))
            and all(_DNS_LABEL.match(c) for c in containers)
            and all(len(k) <= 316 and _LABEL_KEY.match(k) and len(v) <= 63 and _LABEL_VALUE.match(v)
                    for k, v in labels.items()))


class Selector(namedtuple("Selector", "namespace pod labels container", defaults=(None, None, (), None))):
    """Which of the node's pods (and containers) a ``kubernetes:`` item names:
    namespace (exact), pod (a glob of the pod's name), labels ((key, value)
    pairs, all of them the pod's), container (a container's name; None: the
    pod's whole cgroup)."""

    __slots__ = ()

    def matches(self, namespace: str, name: str, labels: dict) -> bool:
        return ((self.namespace is None or namespace == self.namespace)
                and (self.pod is None or fnmatch.fnmatchcase(name, self.pod))
                and all(labels.get(k) == v for k, v in self.labels))

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in (("namespace", self.namespace), ("pod", self.pod)) if v is not None]
        parts += [f"label {k}={v}" for k, v in self.labels]
        if self.container is not None:
            parts.append(f"container={self.container}")
        return ",".join(parts)


def _name(v, key: str, pattern=_NAME, what: str = "a Kubernetes name (lower case letters, digits, - and .)") -> str:
    s = Str()(v, key)
    if len(s) > 253 or not pattern.match(s):
        raise ConfigError(f"{key}: must be {what}, got {quote(v)}")
    return s


def selector(v, key: str) -> Selector:
    """A captures item's ``kubernetes:`` mapping."""
    keys = ("namespace", "pod", "labels", "container")
    if not isinstance(v, dict) or not v:
        raise ConfigError(f"{key}: must be a mapping of {', '.join(keys)} (at least one), got {quote(v)}")
    bad = [k for k in v if k not in keys]
    if bad:
        raise ConfigError(f"{key}.{quote(bad[0]) if not isinstance(bad[0], str) else bad[0]}: unknown key "
                          f"(expected one of {', '.join(keys)})")
    if v.get("labels", None) == {} and not set(v) & {"namespace", "pod"}:     # an empty labels map is no selector
        raise ConfigError(f"{key}.labels: an empty mapping would name every pod of the node: give a label, or "
                          "namespace or pod")
    if set(v) == {"container"}:
        raise ConfigError(f"{key}: a container alone would name that container in every pod of the node: "
                          "give namespace, pod or labels too")
    labels = v.get("labels", {})
    if not isinstance(labels, dict):
        raise ConfigError(f"{key}.labels: must be a mapping of label to value, got {quote(labels)}")
    pairs = []
    for lk, lv in labels.items():
        if not isinstance(lk, str) or not _LABEL_KEY.match(lk) or len(lk) > 316:
            raise ConfigError(f"{key}.labels: {quote(lk)} is not a label key")
        if not isinstance(lv, str) or not _LABEL_VALUE.match(lv) or len(lv) > 63:
            raise ConfigError(f"{key}.labels.{lk}: must be a label value (a string of at most 63 letters, "
                              f"digits, - _ .), got {quote(lv)}")
        pairs.append((lk, lv))
    return Selector(
        _name(v["namespace"], f"{key}.namespace") if "namespace" in v else None,
        _name(v["pod"], f"{key}.pod", _GLOB, "a pod name or a glob of one (* ? [...])") if "pod" in v else None,
        tuple(sorted(pairs)),
        _name(v["container"], f"{key}.container") if "container" in v else None)


def _url(v, key: str) -> str:
    s = "off" if v is False else Str()(v, key)          # YAML 1.1 reads a bare off as false
    if s not in ("auto", "off") and not s.startswith("https://"):
        raise ConfigError(f"{key}: must be auto, off or an https URL of the kubelet's /pods (its token is not "
                          f"sent in the clear), got {quote(v)}")
    return s


KUBERNETES = Section("kubernetes",
    Key("kubelet_url", Check(_url, "auto, off, or an https URL"), "auto",
        "the node's kubelet's pod list (names, labels): auto is https://$NODE_IP:10250/pods, else $NODE_NAME's, "
        "where the downward API sets one, else none; without it, records carry pod UIDs and container ids only"),
    Key("token_file", Str(), f"{SA}/token", "the bearer token sent to the kubelet (read at each poll: it rotates)"),
    Key("ca_file", Str(), f"{SA}/ca.crt", "the CA the kubelet's certificate is checked against"),
    Key("insecure_skip_verify", Bool(), False, "do not check the kubelet's certificate (a self-signed one)"),
    Key("poll_seconds", Int(1, 3600), 10, "the kubelet is asked this often (and sooner, at most every second, "
        "when a pod appears that it did not list)"),
    Key("timeout_seconds", Int(1, 60), 5, "a whole answer from the kubelet within this, or the poll failed"),
    Key("max_bytes", Int(1 << 16, 1 << 30), 8 << 20, "the largest pod list taken from the kubelet"),
    Key("cgroup_root", Str(), "auto", "where the kubelet's cgroups are looked for: auto is the cgroup v2 mount"),
    Key("cgroup_poll_ms", Int(100, 60000), 1000, "the pods' cgroups are looked at this often while a "
        "kubernetes target is in force (pods started and stopped)"))
METRICS = Section("metrics",
    Key("kubernetes_labels", Bool(), False, "nettap_kubernetes_* series: captured connections' counts by "
        "namespace, pod and container (kubernetes.md#metrics)"),
    Key("kubernetes_max_series", Int(1, 100000), 1000, "containers with series of their own; the others' counts "
        "go to pod=\"other\" (nettap_kubernetes_series_folded_total)"))


class Kube(namedtuple("Kube", KUBERNETES.names + METRICS.names,
                      defaults=KUBERNETES.defaults(KUBERNETES.names) + METRICS.defaults(METRICS.names))):
    """The kubernetes: and metrics: sections, checked."""

    __slots__ = ()


def settings(kube, metrics) -> Kube:
    k, m = KUBERNETES.mapping(kube), METRICS.mapping(metrics)
    return Kube(*(KUBERNETES.get(k, n) for n in KUBERNETES.names), *(METRICS.get(m, n) for n in METRICS.names))
