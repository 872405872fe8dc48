"""Kubernetes identity from a cgroup's path, as the kubelet lays them out.

The kubelet puts every pod in a cgroup of its own under ``kubepods``, by QoS
class, and the container runtime puts each container in a cgroup below its
pod's (pkg/kubelet/cm/cgroup_manager_linux.go, qos_container_manager_linux.go):

- systemd driver: ``kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<id>.scope``
  (``besteffort`` the same; a guaranteed pod sits right under kubepods.slice:
  ``kubepods-pod<uid>.slice``); the scope is ``cri-containerd-<id>``,
  ``crio-<id>`` or ``docker-<id>``. A kubelet with a cgroup root of its own
  (kind: ``kubelet.slice/kubelet-kubepods.slice/...``) prefixes every name;
- cgroupfs driver: ``kubepods/burstable/pod<uid>/<id>`` (``kubepods/pod<uid>``
  for guaranteed), the container's directory its bare id (CRI-O: ``crio-<id>``);
- cgroup v1: the same under each controller's directory
  (``/sys/fs/cgroup/memory/kubepods/...``), and /proc/PID/cgroup's lines
  ``N:controllers:/kubepods/...``.

:func:`parse` is pure: a path in, an :class:`Identity` (or None) out.
"""
from __future__ import annotations

import re
from collections import namedtuple

QOS = ("guaranteed", "burstable", "besteffort")
# a container's cgroup name -> its runtime (the kubelet's runtimes' names, as
# containerStatuses[].containerID prefixes them: containerd://, cri-o://, docker://)
_SCOPE = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", None: ""}
_UID = r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
_POD_SLICE = re.compile(r"^(?:.*-)?kubepods(?:-(burstable|besteffort))?-pod" + _UID + r"\.slice$")
_POD_DIR = re.compile(r"^pod" + _UID + "$")
_QOS_SLICE = re.compile(r"^(?:.*-)?kubepods-(burstable|besteffort)\.slice$")


class Identity(namedtuple("Identity", "pod_uid qos runtime container_id")):
    """pod_uid: the pod's UID (with dashes, as the API has it); qos: one of
    QOS; runtime: containerd, cri-o, docker, or "" where the path does not
    say (cgroupfs); container_id: 64 hex digits, "" for the pod's own cgroup."""

    __slots__ = ()


def is_kubepods(name: str) -> bool:
    return name in ("kubepods", "kubepods.slice") or name.endswith("-kubepods.slice")


def parse(path: str) -> Identity | None:
    """The pod (and container) a cgroup path belongs to; None when it is
    not a pod's cgroup (kubepods itself, a QoS class, anything else). A
    cgroup below a container's (a process that made its own) is that
    container's."""
    parts = [p for p in path.split("/") if p]
    for i, name in enumerate(parts):
        if is_kubepods(name):
            return _below(parts[i + 1:])
    return None


def _below(parts: list) -> Identity | None:
    """The kubepods-relative parts: [qos], pod, [container, ...]."""
    if not parts:
        return None
    qos = "guaranteed"
    q = _QOS_SLICE.match(parts[0])
    if q or parts[0] in ("burstable", "besteffort"):
        qos = q.group(1) if q else parts[0]
        parts = parts[1:]
    if not parts:
        return None
    m = _POD_SLICE.match(parts[0])
    if m:
        if (m.group(1) or "guaranteed") != qos:
            return None                     # kubepods-burstable-pod... under besteffort: not the kubelet's
        uid = m.group(2)
    else:
        m = _POD_DIR.match(parts[0])
        if not m:
            return None
        uid = m.group(1)
    uid = uid.replace("_", "-")
    if len(parts) == 1:
        return Identity(uid, qos, "", "")
    c = _SCOPE.match(parts[1])
    if not c:
        return None                          # crio-conmon-<id>.scope, a runtime's own: no container
    return Identity(uid, qos, _RUNTIMES[c.group(1)], c.group(2))


def from_proc_cgroup(text: str) -> Identity | None:
    """The identity /proc/PID/cgroup gives (cgroup v1 lines
    ``N:controller,...:/path``, the v2 line ``0::/path``): the first line
    that names a pod's cgroup."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        ident = parse(path)
        if ident:
            return ident
    return None
