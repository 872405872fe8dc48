"""Kernel tests of capture.records: the default publishes a connection's
owner, chunks and eof (8 lines for a request on a new connection with both
ends captured), not its state and destroy lines, and leaves the programs
only the other kinds need unattached; a reload asking for every kind
attaches them again; a kind left out is not published but still counted."""
import os
import socket
from collections import Counter

import pytest
from traffic import requests

from exporter import config
from exporter.kernel import tcp_h

# The kinds are tested in the programs every mechanism shares (emit.bpf.h,
# obs.bpf.h, lifecycle.bpf.c): once per BPF variant.
pytestmark = pytest.mark.per_variant
CONNS = 20
SIZE = 64                     # one chunk each way (a chunk holds 396 bytes)
KINDS_OFF = ("tcp_timer", "tcp_timer_exit", "tcp_segment")      # the default asks for none of their kinds


def _listener(n: int = CONNS):
    """n connections to a listener of our own: a request, an answer, the
    client closes first, then the server. Returns the port."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(n)
    port = lst.getsockname()[1]
    return lst, port


def _drive(lst, n: int = CONNS) -> None:
    requests(lst, n, SIZE)


def _kinds(lines, port):
    mine = [l for l in lines if port in (l.get("sport"), l.get("dport"))]
    return Counter(l["type"] for l in mine), mine


def _states(run):
    return {p: (st.reported, st.attached) for p, st in run.app.probes.all_states().items()}


def test_the_default_records_of_a_request_on_a_new_connection(nettap_run, mode):
    lst, port = _listener()
    try:
        run = nettap_run({"captures": [{"port": port}], "capture": {"records": list(config.DEFAULT_RECORDS)}})
        states = _states(run)
        assert {p: states[p][0] for p in KINDS_OFF} == dict.fromkeys(KINDS_OFF, "disabled")
        assert states["tcp_accept"][1] and states["tcp_retransmit"][1] and states["tcp_state"][1]
        _drive(lst)
        obs = run.obs_counts()
        lines, _ = run.finish()
    finally:
        lst.close()
    kinds, mine = _kinds(lines, port)
    # per connection: each end's owner, its request or answer both ways, its eof
    assert kinds == {"owner": 2 * CONNS, "chunk": 4 * CONNS, "eof": 2 * CONNS}, kinds
    assert sum(kinds.values()) / CONNS == 8
    # what the state lines said of a normal life, in its eof: its handshake, how it ended
    eofs = [l for l in mine if l["type"] == "eof"]
    assert all(0 < e["established_us"] < 10_000_000 for e in eofs), eofs
    assert {e["oldstate"] for e in eofs} == {"FIN_WAIT2", "LAST_ACK"}, {e["oldstate"] for e in eofs}
    # the state changes are counted still (nettap_tcp_state_changes_total): 5 a socket
    states_counted = int(sum(obs[tcp_h.OBS_STATES:tcp_h.OBS_STATES + 256]))
    assert states_counted >= 10 * CONNS, states_counted


def test_every_kind_when_asked_and_a_kind_left_out_is_counted_not_published(nettap_run, mode):
    """records: all attaches what the default left off, and a request's
    connection has its state and destroy lines; records: [eof] publishes no
    chunk, while eof and the probe counters still have every byte."""
    lst, port = _listener()
    try:
        run = nettap_run({"captures": [{"port": port}], "capture": {"records": list(config.DEFAULT_RECORDS)}})
        run.apply({"captures": [{"port": port}], "capture": {"records": "all"}})  # segments too
        states = _states(run)
        assert all(states[p] == ("tp_btf", True) for p in KINDS_OFF), states
        _drive(lst, 5)
        run.apply({"captures": [{"port": port}], "capture": {"records": ["eof"]}})
        assert all(_states(run)[p][0] == "disabled" for p in KINDS_OFF + ("tcp_accept", "tcp_retransmit"))
        before = run.counters()
        _drive(lst, 5)
        after = run.counters()
        lines, _ = run.finish()
    finally:
        lst.close()
    kinds, mine = _kinds(lines, port)
    # five connections of every kind, then five with their eof lines only
    assert kinds["state"] == 5 * 10 and kinds["destroy"] == 5 * 2 and kinds["owner"] == 5 * 2, kinds
    assert kinds["chunk"] == 5 * 4 and kinds["eof"] == 10 * 2, kinds
    eofs = [l for l in mine if l["type"] == "eof"][-10:]
    assert all((e["tx_bytes"], e["rx_bytes"]) == (SIZE, SIZE) for e in eofs), eofs
    sent = after["tcp_sendmsg"]["bytes"] - before["tcp_sendmsg"]["bytes"]
    assert sent == 10 * SIZE and after["tcp_sendmsg"]["chunks"] == before["tcp_sendmsg"]["chunks"]


def test_each_target_its_own_records(nettap_run, mode):
    """records: on a target: its sockets publish those kinds, the others'
    capture.records; a socket two targets match publishes what either asks
    (decided with its capture); the programs follow the union."""
    lst_all, port_all = _listener()
    lst_eof, port_eof = _listener()
    try:
        run = nettap_run({"captures": [{"port": port_all, "records": "all"}, {"port": port_eof, "records": ["eof"]},
                                       {"pid": os.getpid(), "records": ["chunk"]}],
                          "capture": {"records": ["owner"]}})
        assert all(_states(run)[p] == ("tp_btf", True) for p in KINDS_OFF), _states(run)
        _drive(lst_all, 5)
        _drive(lst_eof, 5)
        lines, _ = run.finish()
    finally:
        lst_all.close()
        lst_eof.close()
    every, _ = _kinds(lines, port_all)
    # every kind (segments too) of port_all's connections; the pid target's chunks are among them
    assert (every["state"], every["destroy"], every["owner"], every["chunk"], every["eof"]) == (50, 10, 10, 20, 10)
    assert every["segment"] > 0, every
    # port_eof's: its eof, and the chunks the pid target (this process) asks for: not the owner capture.records
    # names (no target of theirs takes it)
    assert _kinds(lines, port_eof)[0] == {"eof": 10, "chunk": 20}, _kinds(lines, port_eof)[0]
