"""Owner lines gain their pod and container (exporter/capture/kubelines.py),
keys in byte order as every line's, and captured connections are counted by
workload, capped."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema

from exporter.capture.kube import Node
from exporter.capture.kubelet import Pod
from exporter.capture.kubelines import OTHER, Lines, Workloads
from exporter.metrics.kubernetes import KubernetesCollector
from exporter.util.kubeconfig import Kube

FIX = Path(__file__).parent / "fixtures" / "records"
UID = "0b6e4a3c-5f2d-4e8a-9c1b-7a2d3e4f5a6b"
CID = "2" * 64
POD = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
OWNER = (FIX / "owner.jsonl").read_text().splitlines()[0].encode() + b"\n"
EOF_LINE = (FIX / "eof.jsonl").read_text().splitlines()[0].encode() + b"\n"
RESET = (FIX / "reset.jsonl").read_text().splitlines()[0].encode() + b"\n"


class FakeKubelet:
    results: dict = {}
    last_success, skipped = 0.0, 0

    def __init__(self, pods=()):
        self.pods = {p.uid: p for p in pods}
        self.generation = 1


def _node(tmp_path, kubelet=None):
    os.makedirs(tmp_path / POD / f"cri-containerd-{CID}.scope")
    node = Node()
    node.root, node.settings, node.kubelet = str(tmp_path), Kube(), kubelet
    node.scan()
    return node, os.stat(tmp_path / POD / f"cri-containerd-{CID}.scope").st_ino, os.stat(tmp_path / POD).st_ino


def _owner(cgroup_id: int, conn_id: int = 2) -> bytes:
    return OWNER.replace(b'{"cgroup_id":5,', b'{"cgroup_id":%d,' % cgroup_id).replace(
        b'"conn_id":2,', b'"conn_id":%d,' % conn_id)


def test_owner_lines_gain_the_pod_and_container_in_byte_order(tmp_path):
    pod = Pod("shop", "checkout-7d9f8b6c5-x2k4q", UID, {"app": "checkout"}, {CID: "api"})
    node, container, pod_cg = _node(tmp_path, FakeKubelet([pod]))
    lines = Lines(node)
    batch = RESET + _owner(container) + _owner(123456789) + _owner(pod_cg) + RESET
    out = lines.obs_events(batch).splitlines()
    assert out[0] + b"\n" == RESET and out[4] + b"\n" == RESET and out[2] + b"\n" == _owner(123456789)
    first, third = json.loads(out[1]), json.loads(out[3])
    for d in (first, third):
        assert list(d) == sorted(d, key=str.encode)
    assert {k: first[k] for k in ("namespace", "pod", "pod_uid", "container", "container_id")} == \
        {"namespace": "shop", "pod": "checkout-7d9f8b6c5-x2k4q", "pod_uid": UID, "container": "api",
         "container_id": CID}
    assert first == {**json.loads(_owner(container)), **first}        # the rest as written
    assert "container" not in third and third["pod_uid"] == UID and third["pod"] == "checkout-7d9f8b6c5-x2k4q"
    schema = json.loads((FIX.parents[3] / "docs" / "records.schema.json").read_text())
    for d in (first, third):                    # the contract's schema knows the keys (optional)
        jsonschema.Draft202012Validator(schema).validate(d)
    bad = {**first, "pods": "x"}
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


def test_without_the_kubelet_the_ids_only(tmp_path):
    node, container, _ = _node(tmp_path)
    d = json.loads(Lines(node).obs_events(_owner(container)))
    assert (d["pod_uid"], d["container_id"]) == (UID, CID)
    assert not {"namespace", "pod", "container"} & set(d)
    assert list(d) == sorted(d, key=str.encode)


def test_a_batch_without_owner_lines_is_returned_as_it_is(tmp_path):
    node, _, _ = _node(tmp_path)
    batch = RESET * 3
    assert Lines(node).obs_events(batch) is batch


def test_workloads_counted_from_owner_eof_and_reset_lines_capped(tmp_path):
    pod = Pod("shop", "checkout-1", UID, {}, {CID: "api"})
    node, container, _ = _node(tmp_path, FakeKubelet([pod]))
    w = Workloads(max_series=1)
    lines = Lines(node, w)
    # the eof of connection 7 before its owner line (another ring, drained first): counted once it comes
    lines.capture_eof(EOF_LINE.replace(b'"conn_id":2,', b'"conn_id":7,'))
    lines.obs_events(_owner(container, 7) + _owner(container, 2) + RESET + _owner(999, 3))
    lines.capture_eof(EOF_LINE)                  # conn 2: rx_bytes 7, rx_calls 9, tx_bytes 6, tx_calls 8
    series, folded, _ = w.snapshot()
    assert series == {("shop", "checkout-1", "api"): [2, 12, 14, 16, 18, 1, 0]} and folded == 0
    w.owner(8, ("jobs", "batch", "work"))        # past the cap: folded into OTHER
    series, folded, _ = w.snapshot()
    assert series[OTHER][0] == 1 and folded == 1 and len(series) == 2

    class FakeNode:
        kubelet, cgroups = None, {1: None}

        def pods_gone(self, uids):
            return set()
    fams = {f.name: f for f in KubernetesCollector(FakeNode(), lambda: w, lambda: 3).collect()}
    assert {tuple(s.labels.values()): s.value for s in fams["nettap_kubernetes_bytes"].samples
            if s.name.endswith("_total") and s.labels["pod"] == "checkout-1"} == \
        {("shop", "checkout-1", "api", "sent"): 12, ("shop", "checkout-1", "api", "received"): 14}
    assert fams["nettap_kubernetes_series_folded"].samples[0].value == 1
    assert fams["nettap_kubernetes_line_edit_failures"].samples[0].value == 3


def test_an_owner_seen_before_its_cgroup_is_named_once_the_cgroup_is_seen(tmp_path, monkeypatch):
    """A container started after the last scan, its owner line within the
    scan's rate limit: unnamed then, but not taken for no pod's."""
    node, _, _ = _node(tmp_path)
    lines = Lines(node)
    cdir = tmp_path / POD / f"cri-containerd-{'7' * 64}.scope"
    os.makedirs(cdir)
    new = os.stat(cdir).st_ino
    node._scanned_at = float("inf")              # a scan just made: none now
    assert "pod_uid" not in json.loads(lines.obs_events(_owner(new)))
    node._scanned_at = float("-inf")
    assert json.loads(lines.obs_events(_owner(new)))["container_id"] == "7" * 64
    node._scanned_at = float("-inf")
    assert "pod_uid" not in json.loads(lines.obs_events(_owner(4242)))        # scanned for: no pod's
    assert node.no_pods(4242)


def test_conn_id_zero_is_no_connection_to_count_by(tmp_path):
    """conn_id 0 is "none or unknown": owner lines with it are counted as
    connections, but an eof or reset line with it is no one's."""
    pod = Pod("shop", "checkout-1", UID, {}, {CID: "api"})
    node, container, _ = _node(tmp_path, FakeKubelet([pod]))
    w = Workloads(max_series=10)
    lines = Lines(node, w)
    zero = b'"conn_id":0,'
    lines.capture_eof(EOF_LINE.replace(b'"conn_id":2,', zero))            # before any owner: kept for none
    lines.obs_events(_owner(container, 0) + RESET.replace(b'"conn_id":2,', zero))
    lines.capture_eof(EOF_LINE.replace(b'"conn_id":2,', zero))
    series, _, _ = w.snapshot()
    assert series == {("shop", "checkout-1", "api"): [1, 0, 0, 0, 0, 0, 0]}


def test_the_series_of_a_pod_gone_from_the_list_and_the_cgroups_are_dropped(tmp_path):
    """A rollout's old pods: once a pod is in neither the kubelet's list nor
    the cgroups' scan, its series go at the next scrape (and its room under
    metrics.kubernetes_max_series)."""
    kubelet = FakeKubelet([Pod("shop", "checkout-1", UID, {}, {CID: "api"})])
    node, container, _ = _node(tmp_path, kubelet)
    node.present = True
    w = Workloads(max_series=1)
    lines = Lines(node, w)
    lines.obs_events(_owner(container, 5))

    def series():
        fams = {f.name: f for f in KubernetesCollector(node, lambda: w, lambda: 0).collect()}
        return {s.labels["pod"] for s in fams["nettap_kubernetes_connections"].samples}
    assert series() == {"checkout-1"}
    kubelet.pods = {}                                   # out of the list, its cgroup still here: kept
    assert series() == {"checkout-1"}
    kubelet.pods = {UID: Pod("shop", "checkout-1", UID, {}, {CID: "api"})}
    for d in (tmp_path / POD / f"cri-containerd-{CID}.scope", tmp_path / POD):
        d.rmdir()
    node.scan()
    assert series() == {"checkout-1"}                    # in the list still: kept
    kubelet.pods = {}
    assert series() == set() and w.conns == {}          # gone from both
    w.owner(6, ("shop", "checkout-2", "api"), "another-uid")
    assert w.snapshot()[:2] == ({("shop", "checkout-2", "api"): [1, 0, 0, 0, 0, 0, 0]}, 0)      # room again


def test_a_v1_nodes_owners_are_named_by_process_not_by_their_shared_cgroup(tmp_path, monkeypatch):
    """Where no pod is in cgroup v2 (a v1 node with a v2 mount too), every
    process shares the v2 cgroup id: a host process's owner line, first,
    must not make the pods' owner lines after it no pod's."""
    from tests.unit.test_kubepath import _process
    monkeypatch.setattr("exporter.capture.kube.MIN_RESCAN", 0.0)
    proc = tmp_path / "proc"
    _process(proc, 4, 0, "12:memory:/system.slice/sshd.service\n")
    node = Node(proc=str(proc))
    node.root, node.settings = str(tmp_path / "cg"), Kube()
    os.makedirs(node.root)
    lines = Lines(node)
    assert "pod_uid" not in json.loads(lines.obs_events(_owner(5)))        # pid 4: the host's
    assert node.no_pods(5)
    _process(proc, 9, 0, "12:memory:/kubepods/burstable/pod%s/%s\n" % (UID, CID))
    assert json.loads(lines.obs_events(_owner(5).replace(b'"pid":4,', b'"pid":9,')))["pod_uid"] == UID
