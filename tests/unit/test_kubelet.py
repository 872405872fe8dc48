"""The kubelet's pod list (exporter/capture/kubelet.py) from a real HTTPS
server on loopback that checks a bearer token and answers PodList documents
as a kubelet serves them (tests/unit/fixtures/kubelet/pods.json, written from
the API reference's Pod and PodList), and answers slowly, refuses, answers
malformed or huge documents: each poll bounded and counted, the last good
list kept."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from exporter.capture.kubelet import Kubelet, Malformed, pod_list
from fakekubelet import TOKEN, FakeKubelet, make_cert

PODS = (Path(__file__).parent / "fixtures" / "kubelet" / "pods.json").read_bytes()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return make_cert(tmp_path_factory.mktemp("kubelet-tls"))


@pytest.fixture
def kubelet(cert):
    srv = FakeKubelet(*cert, body=PODS)
    yield srv
    srv.close()


@pytest.fixture
def token(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


def test_pod_list_of_a_kubelets_answer():
    pods = pod_list(PODS)
    checkout = pods["0b6e4a3c-5f2d-4e8a-9c1b-7a2d3e4f5a6b"]
    assert (checkout.namespace, checkout.name) == ("shop", "checkout-7d9f8b6c5-x2k4q")
    assert checkout.labels == {"app": "checkout", "pod-template-hash": "7d9f8b6c5"}
    assert checkout.containers == {"1" * 64: "migrate", "2" * 64: "api", "3" * 64: "envoy"}
    assert pods["9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"].containers == {"4" * 64: "redis"}     # cri-o://
    assert pods["a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d"].containers == {}       # not started: no containerID


@pytest.mark.parametrize("body", [b"<html>", b"[]", b'{"kind": "Pod", "items": []}', b'{"items": [{"spec": {}}]}',
                                  b'{"items": [{"metadata": {"name": "a", "namespace": "b", "uid": 7}}]}',
                                  b'{"items": [{"metadata": {"name": "a", "namespace": "b", "uid": "c", '
                                  b'"labels": {"x": 1}}}]}', b"[" * 100000])
def test_pod_list_refuses_what_is_no_pod_list(body):
    with pytest.raises(Malformed):
        pod_list(body)


def test_polls_with_the_token_over_tls_and_keeps_the_last_good_list(kubelet, token, cert):
    k = Kubelet(kubelet.url, token, cert[0], timeout=1.0, max_bytes=1 << 20)
    assert k.poll() and k.generation == 1 and len(k.pods) == 3 and k.last_success > 0
    good = k.pods
    kubelet.body = b'{"kind": "PodList", "items": [{"metadata": {'            # cut short
    assert not k.poll()
    kubelet.body = json.dumps({"kind": "PodList", "items": [{"metadata": {"name": "x" * 100, "namespace": "n",
                                                                          "uid": str(i)}} for i in range(20000)]})
    kubelet.body = kubelet.body.encode()
    assert len(kubelet.body) > 1 << 20 and not k.poll()                          # huge: refused at 1 MiB
    kubelet.mode = "slow"
    t0 = time.monotonic()
    assert not k.poll()
    assert time.monotonic() - t0 < 3                                             # bounded by the timeout
    kubelet.mode = "forbidden"
    assert not k.poll()
    assert k.pods is good and k.generation == 1
    assert {r: n for r, n in k.results.items() if n} == {"ok": 1, "malformed": 1, "too_large": 1, "timeout": 1,
                                                          "http": 1}
    kubelet.mode, kubelet.body = "ok", PODS
    assert k.poll() and k.generation == 2
    k.close()


def test_refused_wrong_token_unreadable_token_and_an_untrusted_certificate(kubelet, token, tmp_path, cert):
    with socket.socket() as s:                   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"https://127.0.0.1:{s.getsockname()[1]}/pods"
    k = Kubelet(closed, token, cert[0], timeout=1.0)
    assert not k.poll() and k.results["unreachable"] == 1
    bad = tmp_path / "bad"
    bad.write_text("nope")
    k = Kubelet(kubelet.url, str(bad), cert[0], timeout=1.0)
    assert not k.poll() and k.results["http"] == 1                              # 401
    k = Kubelet(kubelet.url, str(tmp_path / "absent"), cert[0], timeout=1.0)
    assert not k.poll() and k.results["token"] == 1
    k = Kubelet(kubelet.url, token, None, timeout=1.0)                          # the system's CAs: not this one
    assert not k.poll() and k.results["unreachable"] == 1 and kubelet.requests == 1
    k = Kubelet(kubelet.url, token, None, insecure=True, timeout=1.0)
    with pytest.warns(Warning):                                                  # urllib3 says it is unchecked
        assert k.poll()


def test_pod_list_refuses_a_status_list_that_is_no_list():
    good = json.loads(PODS)
    good["items"][0]["status"]["containerStatuses"] = 5
    with pytest.raises(Malformed, match=r"items\[0\].status.containerStatuses is not a list"):
        pod_list(json.dumps(good).encode())


def test_the_watch_keeps_polling_after_a_bad_answer_or_a_bug(kubelet, token, cert, tmp_path, monkeypatch):
    """An answer pod_list cannot take, or any exception in a poll, is
    counted and the next poll made: the list follows the kubelet again."""
    from exporter.capture import kube
    from exporter.util.kubeconfig import Kube
    monkeypatch.setattr(kube, "MIN_RESCAN", 0.05)
    bad = json.loads(PODS)
    bad["items"][0]["status"]["containerStatuses"] = 5
    kubelet.body = json.dumps(bad).encode()
    real, calls = pod_list, []

    def flaky(*a):                               # the second answer meets a bug
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return real(*a)
    monkeypatch.setattr("exporter.capture.kubelet.pod_list", flaky)
    node = kube.Node(Kube(kubelet_url=kubelet.url, token_file=token, ca_file=cert[0], poll_seconds=0,
                          timeout_seconds=1, cgroup_root=str(tmp_path)))
    changed = []
    watch = kube.Watch(node, lambda: changed.append(node.kubelet.generation)).start()
    try:
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        kubelet.body = PODS
        while not changed and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop()
        node.close()
    assert changed and len(node.kubelet.pods) == 3
    assert node.kubelet.results["malformed"] >= 1 and node.kubelet.results["error"] == 1


def test_a_pod_with_names_the_api_server_would_not_admit_is_left_out(kubelet, token, cert):
    """A kubelet's names go into lines and label values: a lone surrogate or
    a name no pod can have leaves that pod out (counted), not the list."""
    from fakekubelet import pod, pod_list as body
    good = pod("shop", "checkout-1", "u1", {"app": "checkout"}, {"api": "1" * 64})
    bad = [pod("shop", "x\udc80", "u2", {}, {"api": "2" * 64}), pod("Shop", "a", "u3", {}, {}),
           pod("shop", "a", "u4", {}, {"API": "4" * 64}), pod("shop", "a", "u5", {"app": "a b"}, {}),
           pod("shop", "a" * 254, "u6", {}, {}), pod("shop", "a", "u7", {"a/b/c": "x"}, {})]
    skipped: list = []
    pods = pod_list(json.dumps({"kind": "PodList", "items": [good, *bad]}).encode(), skipped)
    assert list(pods) == ["u1"] and len(skipped) == len(bad)
    assert skipped[0] == "items[1] 'shop/x\\udc80': a name, label or container name the API server would not admit"
    assert pod_list(body(pod("kube-system", "coredns-5d78c9869d-abcde.x", "u8", {"k8s-app": "kube-dns",
                                                                             "example.com/tier": ""}, {"c": "9" * 64})))
    kubelet.body = json.dumps({"kind": "PodList", "items": [good, *bad]}).encode()
    k = Kubelet(kubelet.url, token, cert[0], timeout=1.0)
    assert k.poll() and list(k.pods) == ["u1"] and k.skipped == len(bad)
    k.close()
