"""Kernel tests of capture.sample_connections: the kernel keeps exactly the
connections exporter/capture/sampling.py predicts from their ends, each
whole at both ends (its owners, chunks and eof; its states from the first
when asked), counts each socket it leaves out once, and names the rate in
the owner records. A port target (both ends decided by the socket: the
connect waits for its local port, the accepted child decides at its birth)
and a pid target (the connect in its task, the accept in the accepting
task) take the kernel's two paths."""
import os
import socket
import threading
from collections import Counter

import pytest
from traffic import requests

from exporter.capture import sampling
from exporter.kernel import tcp_h

# The decisions are in the programs every mechanism shares (filter.bpf.h,
# lifecycle.bpf.c, obs.bpf.h) and in each call entry: once per BPF variant
# (the per-mechanism entries all end in captured_fd_sock or enter_func's test).
pytestmark = pytest.mark.per_variant
N = 4
CONNS = 48
SIZE = 64


def _drive(lst, n: int = CONNS) -> list:
    """n requests on new connections (traffic.requests); their client ports."""
    return requests(lst, n, SIZE)


def _check(run, lst, records) -> tuple:
    port = lst.getsockname()[1]
    clients = _drive(lst)
    obs = run.obs_counts()
    lines, _ = run.finish()
    kept = {p for p in clients if sampling.keep(N, "127.0.0.1", p, "127.0.0.1", port)}
    # the prediction is not trivial: some of each, about 1 in N
    assert 0 < len(kept) < len(clients), (len(kept), len(clients))
    mine = [l for l in lines if port in (l.get("sport"), l.get("dport"))]
    client_ports = {l["sport"] if l["dport"] == port else l["dport"] for l in mine}
    assert client_ports == kept, (sorted(client_ports), sorted(kept))
    by_conn = {}
    for l in mine:
        by_conn.setdefault(l["conn_id"], []).append(l)
    assert len(by_conn) == 2 * len(kept)                     # both ends of each kept connection
    for conn_id, ls in by_conn.items():
        kinds = Counter(l["type"] for l in ls)
        assert (kinds["owner"], kinds["chunk"], kinds["eof"]) == (1, 2, 1), (conn_id, kinds)
        assert [l["sample"] for l in ls if l["type"] == "owner"] == [N]
        if "state" in records:                               # whole from its first state on
            states = [(l["oldstate"], l["newstate"]) for l in ls if l["type"] == "state"]
            assert states[0] in (("CLOSE", "SYN_SENT"), ("LISTEN", "SYN_RECV")), (conn_id, states)
            assert states[-1][1] == "CLOSE", (conn_id, states)
    # each end of each connection left out counted once
    assert int(obs[tcp_h.OBS_SAMPLED]) == 2 * (len(clients) - len(kept)), int(obs[tcp_h.OBS_SAMPLED])
    return mine


def test_a_port_target_keeps_the_predicted_connections_whole_at_both_ends(nettap_run, mode):
    lst = socket.create_server(("127.0.0.1", 0), backlog=CONNS)
    try:
        records = ["chunk", "eof", "owner", "state"]
        run = nettap_run({"captures": [{"port": lst.getsockname()[1]}],
                          "capture": {"records": records, "sample_connections": N}})
        mine = _check(run, lst, records)
    finally:
        lst.close()
    # the client's CLOSE -> SYN_SENT, published once its port decided it, at the connect's time
    first = [l for l in mine if l["type"] == "state" and l["newstate"] == "SYN_SENT"]
    owners = {l["conn_id"]: l for l in mine if l["type"] == "owner" and l["via"] == "connect"}
    assert first and {l["conn_id"] for l in first} == set(owners)
    for l in first:
        assert l["sport"] != 0 and l["ts_ns"] <= owners[l["conn_id"]]["ts_ns"], (l, owners[l["conn_id"]])


def test_a_pid_target_decides_its_connects_and_accepts_alike(nettap_run, mode):
    lst = socket.create_server(("127.0.0.1", 0), backlog=CONNS)
    tid = threading.get_native_id()
    try:
        run = nettap_run({"captures": [{"pid": os.getpid()}], "capture": {"sample_connections": N}})
        mine = _check(run, lst, ())
    finally:
        lst.close()
    owners = [l for l in mine if l["type"] == "owner"]
    assert Counter(l["via"] for l in owners) == {"connect": len(owners) // 2, "accept": len(owners) // 2}
    # the connect's owner is its task as it connected, kept while its port was not bound
    assert {(l["tid"], l["pid"]) for l in owners} == {(tid, os.getpid())}
