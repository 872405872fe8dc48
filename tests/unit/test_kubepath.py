"""Kubernetes identity from cgroup paths (exporter/capture/kubepath.py), the
kubelet's cgroups found in a directory tree (kubecgroups.py), and the
selectors matched against them (kube.Node.match)."""
from __future__ import annotations

import os

import pytest

from exporter.capture import kubecgroups, kubepath
from exporter.capture.kube import Node
from exporter.capture.kubelet import Pod
from exporter.capture.kubepath import Identity
from exporter.util.kubeconfig import Kube, Selector

UID = "0b6e4a3c-5f2d-4e8a-9c1b-7a2d3e4f5a6b"
U_ = UID.replace("-", "_")
CID = "2222222222222222222222222222222222222222222222222222222222222222"


@pytest.mark.parametrize("path, want", [
    # systemd driver, cgroup v2 (containerd, CRI-O, Docker)
    (f"/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/"
     f"cri-containerd-{CID}.scope", Identity(UID, "burstable", "containerd", CID)),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/crio-{CID}.scope",
     Identity(UID, "besteffort", "cri-o", CID)),
    (f"/kubepods.slice/kubepods-pod{U_}.slice/docker-{CID}.scope", Identity(UID, "guaranteed", "docker", CID)),
    # the pod's own cgroup
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice", Identity(UID, "burstable", "", "")),
    (f"/kubepods.slice/kubepods-pod{U_}.slice", Identity(UID, "guaranteed", "", "")),
    # a process's own cgroup below its container's: the container's
    (f"/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope/worker", Identity(UID, "guaranteed",
                                                                                            "containerd", CID)),
    # a kubelet with a cgroup root of its own (kind)
    (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{U_}.slice/cri-containerd-{CID}.scope",
     Identity(UID, "besteffort", "containerd", CID)),
    # cgroupfs driver, v2 and v1 (under a controller's directory)
    (f"/sys/fs/cgroup/kubepods/burstable/pod{UID}/{CID}", Identity(UID, "burstable", "", CID)),
    (f"/sys/fs/cgroup/memory/kubepods/besteffort/pod{UID}/{CID}", Identity(UID, "besteffort", "", CID)),
    (f"/sys/fs/cgroup/cpu,cpuacct/kubepods/pod{UID}/{CID}", Identity(UID, "guaranteed", "", CID)),
    (f"/kubepods/burstable/pod{UID}/crio-{CID}", Identity(UID, "burstable", "cri-o", CID)),
    (f"/kubepods/pod{UID}", Identity(UID, "guaranteed", "", "")),
    # not a pod's
    ("/kubepods.slice", None),
    ("/kubepods.slice/kubepods-burstable.slice", None),
    ("/kubepods/besteffort", None),
    ("/system.slice/containerd.service", None),
    (f"/user.slice/pod{UID}/{CID}", None),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/crio-conmon-{CID}.scope", None),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod{U_}.slice", None),   # QoS names disagree
    (f"/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID[:-1]}.scope", None),      # 63 digits
    (f"/kubepods/burstable/pod{UID[:-1]}/{CID}", None),
    ("", None),
])
def test_parse(path, want):
    assert kubepath.parse(path) == want


def test_from_proc_cgroup_v1_and_v2():
    v1 = ("12:memory:/kubepods/burstable/pod%s/%s\n11:cpu,cpuacct:/kubepods/burstable/pod%s/%s\n"
          "1:name=systemd:/kubepods/burstable/pod%s/%s\n" % ((UID, CID) * 3))
    assert kubepath.from_proc_cgroup(v1) == Identity(UID, "burstable", "", CID)
    v2 = f"0::/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope\n"
    assert kubepath.from_proc_cgroup(v2) == Identity(UID, "guaranteed", "containerd", CID)
    assert kubepath.from_proc_cgroup("0::/user.slice/user-0.slice/session-1.scope\n") is None


def _tree(root, *paths):
    for p in paths:
        os.makedirs(os.path.join(root, p))
    return {p: os.stat(os.path.join(root, p)).st_ino for p in paths}


SYSTEMD = (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope",
           f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{'3' * 64}.scope",
           f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope/sub",
           "kubepods.slice/kubepods-pod9f8e7d6c_5b4a_4392_8170_6f5e4d3c2b1a.slice/crio-" + "4" * 64 + ".scope",
           "system.slice/containerd.service")


def test_scan_finds_pods_and_containers_with_their_levels(tmp_path):
    ino = _tree(tmp_path, *SYSTEMD)
    found = kubecgroups.scan(str(tmp_path), root_level=2)
    pod = os.path.dirname(SYSTEMD[0])
    for d in (pod, os.path.dirname(SYSTEMD[3])):
        ino[d] = os.stat(tmp_path / d).st_ino
    want = {ino[SYSTEMD[0]]: (CID, 6), ino[SYSTEMD[1]]: ("3" * 64, 6), ino[pod]: ("", 5),
            ino[SYSTEMD[3]]: ("4" * 64, 5), ino[os.path.dirname(SYSTEMD[3])]: ("", 4)}
    assert {c: (cg.identity.container_id, cg.level) for c, cg in found.items()} == want   # not .../sub
    assert found[ino[SYSTEMD[0]]].path == str(tmp_path / SYSTEMD[0])
    assert set(kubecgroups.pod_cgroups(found)) == {UID, "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"}


def test_scan_cgroupfs_and_a_kubelet_root_of_its_own(tmp_path):
    ino = _tree(tmp_path, f"kubepods/besteffort/pod{UID}/{CID}", f"kubelet.slice/kubelet-kubepods.slice/"
                f"kubelet-kubepods-pod{'a1b2c3d4_e5f6_4a7b_8c9d_0e1f2a3b4c5d'}.slice/cri-containerd-{'5' * 64}.scope")
    found = kubecgroups.scan(str(tmp_path))
    assert sorted((cg.identity.container_id, cg.level) for c, cg in found.items() if c in ino.values()) == \
        [(CID, 4), ("5" * 64, 4)]
    assert len(found) == 4                    # and the two pods' own


class FakeKubelet:
    generation = 1

    def __init__(self, pods):
        self.pods = {p.uid: p for p in pods}


def _node(tmp_path, pods) -> Node:
    node = Node()
    node.root, node.settings = str(tmp_path), Kube()
    node.kubelet = FakeKubelet(pods)
    node.scan()
    return node


def test_match_pods_by_namespace_glob_labels_and_container(tmp_path):
    ino = _tree(tmp_path, *SYSTEMD[:2])
    pod_ino = os.stat(tmp_path / os.path.dirname(SYSTEMD[0])).st_ino
    checkout = Pod("shop", "checkout-7d9f8b6c5-x2k4q", UID, {"app": "checkout"}, {CID: "api", "3" * 64: "envoy"})
    node = _node(tmp_path, [checkout])
    assert node.match(Selector("shop", "checkout-*")) == {pod_ino: 3}
    assert node.match(Selector(None, None, (("app", "checkout"),), "api")) == {ino[SYSTEMD[0]]: 4}
    assert node.match(Selector("shop", "checkout-*", (), "envoy")) == {ino[SYSTEMD[1]]: 4}
    for miss in (Selector("shop", "cart-*"), Selector("other"), Selector(None, None, (("app", "cart"),)),
                 Selector("shop", None, (), "sidecar")):
        assert node.match(miss) == {}
    node.kubelet = None                       # no names without the kubelet: nothing matches
    assert node.match(Selector("shop")) == {}


def test_identity_of_a_new_cgroup_scans_once_and_remembers_unknown_ids(tmp_path, monkeypatch):
    node = _node(tmp_path, [])
    monkeypatch.setattr("exporter.capture.kube.MIN_RESCAN", 0.0)
    scans = node.scans
    ino = _tree(tmp_path, SYSTEMD[0])
    assert node.identity(ino[SYSTEMD[0]]) == Identity(UID, "burstable", "containerd", CID)
    assert node.scans == scans + 1
    other = os.stat(tmp_path / "system.slice").st_ino if (tmp_path / "system.slice").exists() else 1
    assert node.identity(other) is None and node.identity(other) is None
    assert node.scans == scans + 2            # the unknown id scanned for once
    assert node.names(node.identity(ino[SYSTEMD[0]])) == ("", "", "")


def test_the_kubelets_url_from_the_downward_api():
    from exporter.capture.kube import kubelet_url
    assert kubelet_url("auto", {"NODE_IP": "10.0.0.11", "NODE_NAME": "node-a"}) == "https://10.0.0.11:10250/pods"
    assert kubelet_url("auto", {"NODE_IP": "fd00::11"}) == "https://[fd00::11]:10250/pods"
    assert kubelet_url("auto", {"NODE_NAME": "node-a"}) == "https://node-a:10250/pods"
    assert kubelet_url("auto", {}) is None and kubelet_url("off", {"NODE_NAME": "a"}) is None
    assert kubelet_url("https://k:10250/pods", {}) == "https://k:10250/pods"


def _process(proc, pid: int, start_ticks: int, cgroup: str) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", str(pid), str(pid)] + ["0"] * 15 + [str(start_ticks)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} (a) b) " + " ".join(fields) + "\n")
    (d / "cgroup").write_text(cgroup)


def test_a_v1_nodes_owner_by_process_cached_by_pid_and_start_time(tmp_path, monkeypatch):
    """Where no pod is in cgroup v2, the owner's pod is its process's
    (/proc/PID/cgroup), read once per process (pid and start time), and
    never that of a process started after the record (the pid reused)."""
    import time
    proc = tmp_path / "proc"
    v1 = "12:memory:/kubepods/burstable/pod%s/%s\n" % (UID, CID)
    other = ("12:memory:/kubepods/besteffort/pod%s/%s\n" % (UID.replace("0b", "1c"), "5" * 64))
    _process(proc, 123, 1, v1)
    node = Node(proc=str(proc))
    node.settings = Kube()
    reads = []
    real = kubecgroups.proc_identity
    monkeypatch.setattr(kubecgroups, "proc_identity", lambda p, pid: reads.append(pid) or real(p, pid))
    now = time.monotonic_ns()
    want = Identity(UID, "burstable", "", CID)
    assert node.identity(77, 123, now) == want and node.identity(77, 123, now) == want and reads == [123]
    boot_now = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // node.processes.tick_ns
    _process(proc, 123, boot_now + 100, other)               # exited; its pid is a newer process's
    assert node.identity(77, 123, now) is None and reads == [123]          # after the record: not its
    assert node.identity(77, 123, time.monotonic_ns() + 10 * 10**9).pod_uid == UID.replace("0b", "1c")
    assert reads == [123, 123]
    assert node.identity(77, 999, now) is None                              # gone


def test_an_id_looked_up_between_scans_is_no_pods_after_the_next_scan(tmp_path):
    """A host process's cgroup id looked up while scans are rate limited is
    settled by the next scan begun after the lookup, whichever thread makes
    it (the watch's), not only by a scan the lookup makes itself."""
    node = _node(tmp_path, [])
    node._scanned_at = float("inf")              # a scan just made: none from a lookup now
    assert node.cgroup(4242) is None and not node.no_pods(4242)
    ino = _tree(tmp_path, SYSTEMD[0])[SYSTEMD[0]]
    assert node.cgroup(ino) is None              # a container started since the last scan
    node.scan()                                  # the watch's
    assert node.no_pods(4242) and not node.no_pods(ino) and node.cgroup(ino).identity.container_id == CID
    node._pending[4343] = float("inf")           # looked up after this scan began: not settled by it
    node.scan()
    assert not node.no_pods(4343)


def test_a_poll_that_outlives_the_watchs_stop_changes_nothing(tmp_path, monkeypatch):
    """Shutdown waits STOP_WAIT for the kubelet's thread, and a poll may take
    longer: its answer then must not reach on_change (the maps it writes are
    being closed)."""
    import threading

    from exporter.capture import kube
    monkeypatch.setattr(kube, "STOP_WAIT", 0.1, raising=False)
    answer, asked = threading.Event(), threading.Event()

    class SlowKubelet:
        generation, pods = 0, {}

        def poll(self):
            asked.set()
            answer.wait(5)
            self.generation = 1
            return True
    node = _node(tmp_path, [])
    node.kubelet = SlowKubelet()
    changed = []
    watch = kube.Watch(node, lambda: changed.append(1)).start()
    assert asked.wait(5)
    watch.stop()
    answer.set()                                 # the poll answers after stop() returned
    watch._threads[0].join(5)
    assert not watch._threads[0].is_alive() and changed == []
