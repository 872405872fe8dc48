"""Kernel tests: the real probes in this kernel, driven by real loopback
traffic, counted exactly."""
import os
import subprocess
import uuid

import pytest

from conftest import streams
from traffic import ClientProcess, Server, payload, send_messages

pytestmark = pytest.mark.kernel

N, S = 50, 1000          # messages, bytes each: 3 chunks per message (400+400+200)


def chunks_per(size, max_payload=4096):
    return -(-min(size, max_payload) // 400)


def test_port_target_counts_exactly_and_captures_bytes(nettap_run):
    srv, other = Server(), Server()
    # The server reads up to 64 KiB a call: capture all of it, to compare bytes.
    run = nettap_run({"captures": [{"port": srv.port}], "capture": {"max_payload_bytes": 65600}})
    before = run.counters()

    sent = send_messages(srv.port, N, S)
    srv.wait_received(1)
    send_messages(other.port, N, S)           # not captured: adds nothing
    other.wait_received(1)

    c = run.counters()
    snd, rcv = c["tcp_sendmsg"], c["tcp_recvmsg"]
    assert snd["calls"] - before["tcp_sendmsg"]["calls"] == N
    assert snd["returns"] - before["tcp_sendmsg"]["returns"] == N
    assert snd["bytes"] - before["tcp_sendmsg"]["bytes"] == N * S
    assert snd["chunks"] == N * chunks_per(S, 65600)
    assert rcv["bytes"] == N * S
    assert rcv["calls"] == rcv["returns"] >= 2          # data reads + the read of EOF
    assert srv.received == [sent]
    assert run.drops() == {"capture_chunks": 0, "capture_eof": 0, "logs": 0}

    lines, drained = run.finish()
    egress, ingress = streams(lines, "egress"), streams(lines, "ingress")
    assert list(egress.values()) == [sent]             # byte for byte, non-UTF-8 included
    assert list(ingress.values()) == [sent]
    assert drained["capture_chunks"] == snd["chunks"] + rcv["chunks"]
    chunk = next(l for l in lines if l["type"] == "chunk" and l["direction"] == "egress")
    assert chunk["dport"] == srv.port and chunk["daddr"] == "127.0.0.1" and chunk["family"] == "ipv4"
    assert chunk["call_len"] == S and chunk["pid"] == os.getpid()
    eofs = [l for l in lines if l["type"] == "eof"]
    assert sorted((e["tx_bytes"], e["rx_bytes"]) for e in eofs) == [(0, N * S), (N * S, 0)]


def test_uncaptured_traffic_adds_exactly_zero(nettap_run):
    srv = Server()
    run = nettap_run({"captures": [{"port": 1}]})     # a port nothing uses
    send_messages(srv.port, N, S)
    srv.wait_received(1)
    assert all(v == 0 for c in run.counters().values() for v in c.values())
    lines, _ = run.finish()
    assert lines == []


def test_payload_truncated_at_max_payload_keeps_call_length(nettap_run):
    srv = Server()
    run = nettap_run({"captures": [{"port": srv.port}], "capture": {"max_payload_bytes": 1000}})
    send_messages(srv.port, 3, 5000)
    srv.wait_received(1)
    c = run.counters()["tcp_sendmsg"]
    assert c["bytes"] == 15000 and c["chunks"] == 3 * 3
    lines, _ = run.finish()
    eg = [l for l in lines if l["type"] == "chunk" and l["direction"] == "egress"]
    assert {l["call_len"] for l in eg} == {5000}
    assert sorted({l["call_offset"] for l in eg}) == [0, 5000, 10000]
    assert sum(l["len"] for l in eg) == 3000


def test_ipv6_and_vectored_sends(nettap_run):
    srv = Server(host="::1", family=__import__("socket").AF_INET6)
    run = nettap_run({"captures": [{"port": srv.port}]})
    import socket
    data = payload(3000)
    with socket.socket(socket.AF_INET6) as s:
        s.connect(("::1", srv.port))
        assert s.sendmsg([data[:100], data[100:1500], data[1500:]]) == 3000
    srv.wait_received(1)
    c = run.counters()["tcp_sendmsg"]
    assert (c["calls"], c["bytes"]) == (1, 3000)
    lines, _ = run.finish()
    assert list(streams(lines, "egress").values()) == [data]
    l = next(l for l in lines if l["type"] == "chunk")
    assert l["family"] == "ipv6" and l["daddr"] == "::1"


def test_pid_target(nettap_run):
    srv = Server()
    run = nettap_run({"captures": []})
    cl = ClientProcess(srv.port, N, S)
    run.apply({"captures": [{"pid": cl.pid}]})        # targets change without reload
    cl.go()
    srv.wait_received(1)
    send_messages(srv.port, N, S)                     # this process: not captured
    srv.wait_received(2)
    c = run.counters()
    assert c["tcp_sendmsg"]["calls"] == N and c["tcp_sendmsg"]["bytes"] == N * S
    assert c["tcp_recvmsg"]["calls"] == 0             # the server thread is not the pid
    lines, _ = run.finish()
    assert list(streams(lines, "egress").values()) == [payload(N * S)]
    assert {l["pid"] for l in lines if l["type"] == "chunk"} == {cl.pid}


def _v2_root():
    for line in open("/proc/self/mountinfo"):
        pre, _, post = line.partition(" - ")
        if post.startswith("cgroup2 "):
            return pre.split()[4]
    pytest.fail("no cgroup v2 hierarchy mounted")


def test_cgroup_target(nettap_run):
    cg = os.path.join(_v2_root(), f"nettap-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(cg)
    try:
        srv = Server()
        run = nettap_run({"captures": [{"cgroup": cg}]})
        cl = ClientProcess(srv.port, N, S)
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(cl.pid))
        cl.go()
        srv.wait_received(1)
        send_messages(srv.port, N, S)                 # outside the cgroup
        srv.wait_received(2)
        c = run.counters()
        assert c["tcp_sendmsg"]["calls"] == N and c["tcp_sendmsg"]["bytes"] == N * S
        assert c["tcp_recvmsg"]["calls"] == 0
        lines, _ = run.finish()
        assert list(streams(lines, "egress").values()) == [payload(N * S)]
    finally:
        os.rmdir(cg)


NETNS_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
from traffic import Server, send_messages
srv = Server(port=9000)
send_messages(9000, {n}, {s})
srv.wait_received(1)
"""


def test_netns_target(nettap_run):
    from pyroute2 import NetNS, netns
    name = f"nettap-test-{uuid.uuid4().hex[:8]}"
    netns.create(name)
    try:
        with NetNS(name) as ns:                           # bring lo up inside it
            idx = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=idx, state="up")
        run = nettap_run({"captures": [{"netns": f"/var/run/netns/{name}"}]})
        tests = os.path.dirname(os.path.abspath(__file__)) + "/.."
        script = NETNS_SCRIPT.format(tests=os.path.abspath(tests), n=N, s=S)
        subprocess.run(["ip", "netns", "exec", name, "python3", "-c", script], check=True, timeout=60)
        srv = Server(port=9000)                           # same port, root netns: not captured
        send_messages(9000, N, S)
        srv.wait_received(1)
        c = run.counters()
        assert c["tcp_sendmsg"]["calls"] == N and c["tcp_sendmsg"]["bytes"] == N * S
        assert c["tcp_recvmsg"]["bytes"] == N * S
        lines, _ = run.finish()
        assert list(streams(lines, "egress").values()) == [payload(N * S)]
    finally:
        netns.remove(name)


def test_tiny_ring_counts_every_drop(nettap_run):
    srv = Server()
    # 8 chunk slots, and the drain polls every 50 ms: a burst overflows it.
    run = nettap_run({"captures": [], "rings": {"capture_chunks": 4096}, "output": {"type": "none"}})
    n = 5000
    cl = ClientProcess(srv.port, n, 100)     # only the sender is captured:
    run.apply({"captures": [{"pid": cl.pid}], "output": {"type": "none"}})
    cl.go()                                  # exactly one 100-byte chunk per send
    srv.wait_received(1)
    c = run.counters()
    drops = run.drops()["capture_chunks"]
    _, drained = run.finish()
    assert c["tcp_sendmsg"]["calls"] == n
    assert drops > 0
    assert drained["capture_chunks"] == c["tcp_sendmsg"]["chunks"]
    assert drained["capture_chunks"] + drops == n          # produced


def test_fentry_refused_and_tracepoint_chosen(nettap_run):
    run = nettap_run({"captures": []})
    for st in run.app.probes.states.values():
        assert st.mechanism == "tracepoint" and st.attached
        assert "refused" in st.reasons["fentry"]
        assert "no kprobes" in st.reasons["kprobe"]
    text = __import__("prometheus_client").generate_latest(run.app.registry(with_process=False)).decode()
    assert 'nettap_probe_attached{mechanism="tracepoint",probe="tcp_sendmsg"} 1.0' in text
    assert 'nettap_probe_attached{mechanism="tracepoint",probe="tcp_recvmsg"} 1.0' in text
