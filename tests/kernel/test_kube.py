"""Kubernetes targets and identity on real cgroups: the kubelet's hierarchy
made under the cgroup v2 root (systemd-driver names, and the cgroupfs
driver's), a real client process moved into a "container", a local kubelet
(HTTPS, bearer token) serving the PodList that names it. The target by
namespace and pod name must capture it, its owner line must carry its pod
and container, the opted-in metrics their labels; the pod deleted and made
again under a new UID (a rollout) must be followed with no reload."""
from __future__ import annotations

import os
import uuid

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import kernel_cgroups, streams, wait_until
from fakekubelet import TOKEN, FakeKubelet, make_cert, pod, pod_list
from helpers import cgroup_v2_root, move_to_cgroup
from traffic import ClientProcess, Server, payload

N, S = 10, 700


class Hierarchy:
    """The kubelet's cgroups of one pod with one container, under the v2 root,
    laid out as its systemd or cgroupfs driver does (below a kubelet root of
    the test's own, so that no real kubepods is touched). remove() takes
    them away, deepest first (each must be empty)."""

    def __init__(self, layout: str):
        self.top = os.path.join(cgroup_v2_root(), f"nettap-test-{uuid.uuid4().hex[:8]}")
        self.layout, self.made = layout, []

    def add_pod(self, uid: str, cid: str) -> tuple:
        """(the pod's cgroup, its container's) made."""
        if self.layout == "systemd":
            u = uid.replace("-", "_")
            parts = [self.top + ".slice", "k-kubepods.slice", "k-kubepods-burstable.slice",
                     f"k-kubepods-burstable-pod{u}.slice", f"cri-containerd-{cid}.scope"]
        else:
            parts = [self.top, "kubepods", "burstable", f"pod{uid}", cid]
        path = ""
        for p in parts:
            path = os.path.join(path, p) if path else p
            if not os.path.isdir(path):
                os.mkdir(path)
                self.made.append(path)
        return os.path.dirname(path), path

    def remove_pod(self, pod_dir: str) -> None:
        for d in sorted((d for d in self.made if d.startswith(pod_dir)), key=len, reverse=True):
            os.rmdir(d)
            self.made.remove(d)

    def remove(self) -> None:
        for d in sorted(self.made, key=len, reverse=True):
            if os.path.isdir(d):
                os.rmdir(d)
        self.made = []


@pytest.fixture(scope="module")
def kubelet(tmp_path_factory):
    d = tmp_path_factory.mktemp("kubelet")
    cert, key = make_cert(d)
    (d / "token").write_text(TOKEN)
    srv = FakeKubelet(cert, key, pod_list())
    srv.files = (str(d / "token"), cert)
    yield srv
    srv.close()


def scrape(app) -> dict:
    """{(name, labels as sorted items): value} of the exporter's metrics now."""
    text = generate_latest(app.registry(with_process=False)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def owner_lines(lines, pid):
    return [line for line in lines if line["type"] == "owner" and line["pid"] == pid]


def one_client(srv, container: str, count: int) -> ClientProcess:
    cl = ClientProcess(srv.port, N, S)
    move_to_cgroup(container, cl.pid)
    cl.go()
    srv.wait_received(count)
    return cl


# (layout, the target, what it is named as, whether it names the container's cgroup or the pod's)
TARGETS = {"systemd": ("systemd", {"namespace": "shop", "pod": "checkout-*"}, "namespace=shop,pod=checkout-*", False),
           "cgroupfs": ("cgroupfs", {"namespace": "shop", "pod": "checkout-*"}, "namespace=shop,pod=checkout-*", False),
           "container": ("systemd", {"namespace": "shop", "labels": {"app": "checkout"}, "container": "api"},
                         "namespace=shop,label app=checkout,container=api", True)}


def test_pod_target_names_its_records_and_metrics_and_follows_a_new_pod(nettap_run, mode, kubelet):
    """Once per mechanism: the systemd driver's layout (the capture is the mechanism's)."""
    pod_target(nettap_run, kubelet, "systemd")


@pytest.mark.per_variant
@pytest.mark.parametrize("case", ["cgroupfs", "container"])
def test_the_cgroupfs_layout_and_a_target_by_labels_and_container(nettap_run, mode, kubelet, case):
    """Once per kernel: what the layout and the selector change is nettap's user space."""
    pod_target(nettap_run, kubelet, case)


def pod_target(nettap_run, kubelet, case):
    layout, target, text, by_container = TARGETS[case]
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    h = Hierarchy(layout)
    srv = Server()
    try:
        pod_dir, container = h.add_pod(uid, cid)
        kubelet.body = pod_list(pod("shop", "checkout-1", uid, {"app": "checkout"}, {"api": cid}))
        run = nettap_run({"captures": [{"kubernetes": target}],
                          "kubernetes": {"kubelet_url": kubelet.url, "token_file": kubelet.files[0],
                                         "ca_file": kubelet.files[1], "poll_seconds": 1,
                                         "cgroup_root": cgroup_v2_root(), "cgroup_poll_ms": 100},
                          "metrics": {"kubernetes_labels": True}})
        wait_until(lambda: kernel_cgroups(run) == {os.stat(container if by_container else pod_dir).st_ino},
                   what="the target's cgroup in the filter")
        outside = ClientProcess(srv.port, N, S)          # not in the pod: not captured
        outside.go()
        first = one_client(srv, container, 2)
        run.shared.quiet()
        m = scrape(run.app)
        who = (("container", "api"), ("namespace", "shop"), ("pod", "checkout-1"))
        assert m[("nettap_kubernetes_connections_total", who)] == 1
        assert m[("nettap_kubernetes_bytes_total", tuple(sorted(who + (("direction", "sent"),))))] == N * S
        assert m[("nettap_targets_kubernetes_cgroups", (("target", text),))] == 1

        # a rollout: the pod deleted (gone from the kubelet's list: out of the filter, its cgroup still
        # there), another listed under a new UID before the runtime makes its cgroups (seen by the watch)
        uid2, cid2 = str(uuid.uuid4()), uuid.uuid4().hex * 2
        kubelet.body = pod_list(pod("shop", "checkout-2", uid2, {"app": "checkout"}, {"api": cid2}))
        asked = kubelet.requests
        wait_until(lambda: kubelet.requests >= asked + 2 and not kernel_cgroups(run),
                   what="the deleted pod out of the filter")
        h.remove_pod(pod_dir)
        pod_dir2, container2 = h.add_pod(uid2, cid2)
        wait_until(lambda: kernel_cgroups(run) == {os.stat(container2 if by_container else pod_dir2).st_ino},
                   what="the new pod's cgroup alone")
        second = one_client(srv, container2, 3)
        lines, _ = run.finish()
        assert run.app.reloads.failures == 0
    finally:
        srv.close()
        h.remove()
    assert not owner_lines(lines, outside.pid)
    for cl, u, c, name in ((first, uid, cid, "checkout-1"), (second, uid2, cid2, "checkout-2")):
        (own,) = owner_lines(lines, cl.pid)
        assert (own["pod_uid"], own["container_id"], own["namespace"], own["pod"], own["container"]) == \
            (u, c, "shop", name, "api")
        assert list(own) == sorted(own, key=str.encode)
        assert streams(lines, "egress")[own["conn_id"]] == payload(N * S)


@pytest.mark.per_variant
def test_metrics_only_counts_the_pods_without_a_sink(nettap_run, mode, kubelet):
    """output none (the Helm chart's metrics-only install): no line is kept, and the pods' series
    count all the same (the owner and eof lines formatted for them, then dropped)."""
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    h = Hierarchy("systemd")
    srv = Server()
    try:
        pod_dir, container = h.add_pod(uid, cid)
        kubelet.body = pod_list(pod("shop", "checkout-1", uid, {"app": "checkout"}, {"api": cid}))
        run = nettap_run({"captures": [{"kubernetes": {"namespace": "shop", "pod": "checkout-*"}}],
                          "output": {"type": "none"},
                          "kubernetes": {"kubelet_url": kubelet.url, "token_file": kubelet.files[0],
                                         "ca_file": kubelet.files[1], "poll_seconds": 1,
                                         "cgroup_root": cgroup_v2_root(), "cgroup_poll_ms": 100},
                          "metrics": {"kubernetes_labels": True}})
        assert run.app.pipeline.sink is None
        wait_until(lambda: kernel_cgroups(run) == {os.stat(pod_dir).st_ino}, what="the pod's cgroup in the filter")
        one_client(srv, container, 1)
        who = (("container", "api"), ("namespace", "shop"), ("pod", "checkout-1"))
        sent = ("nettap_kubernetes_bytes_total", tuple(sorted(who + (("direction", "sent"),))))
        wait_until(lambda: scrape(run.app).get(sent) == N * S, timeout=60, what="the pod's bytes counted")
        assert scrape(run.app)[("nettap_kubernetes_connections_total", who)] == 1
        run.app.close()
    finally:
        srv.close()
        h.remove()
