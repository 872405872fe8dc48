"""Kernel tests: the segments captured sockets receive (bpf/retransmit.bpf.c,
tcp:tcp_probe), recorded only for the targets that ask (``segments: true``),
on a ring of their own. Real traffic on the loopback of a network namespace
of the test's own."""
import os
import socket
import threading

import pytest

from conftest import live_conn_ids
from procs import wait_for
from traffic import in_netns, listener

# Their programs are tp_btf whatever the call probes' mechanism (loader.SEPARATE):
# once per BPF variant, not once per mechanism.
pytestmark = pytest.mark.per_variant
SEG, PLAIN = 9100, 9101          # a port whose segments are recorded, and one whose are not
SENDS, SIZE = 20, 300            # the client's sends, a segment each (TCP_NODELAY, in turn)
ANSWERS = 1 + SENDS + 2          # the bytes the server sends: its greeting, an answer a send, "ok"


def exchange(port: int) -> int:
    """The server greets ("h": it has accepted, so a task target has decided
    by then); the client sends SENDS x SIZE bytes, each send answered (so
    each is a segment of its own), then the server says "ok". Returns the
    client's port."""
    lsn = listener(port)

    def serve():
        c, _ = lsn.accept()
        with c:
            c.sendall(b"h")
            for _ in range(SENDS):
                got = 0
                while got < SIZE:
                    got += len(c.recv(SIZE - got))
                c.sendall(b"k")
            c.sendall(b"ok")
            c.recv(1)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert c.recv(1) == b"h"
    for _ in range(SENDS):
        c.sendall(b"s" * SIZE)
        assert c.recv(1) == b"k"
    assert c.recv(2) == b"ok"
    sport = c.getsockname()[1]
    c.close()
    t.join(20)
    lsn.close()
    return sport


def _segment_probe(run):
    st = run.app.probes.separate["tcp_segment"]
    if not st.attached:
        pytest.skip(f"tcp_segment not loaded: {st.mechanism}")


def _finish(run):
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket closed")
    lines, drained = run.finish()
    return [l for l in lines if l["type"] == "segment"], drained


def test_segments_are_recorded_for_the_targets_that_ask(nettap_run, mode, ns):
    """Both ports captured, segments on for one: its server socket's
    segments carry every byte the client sent (a passive open, decided by
    the socket targets), its client socket's the answers (decided at its
    connect); the other port's connection has none."""
    run = nettap_run({"captures": [{"port": SEG, "segments": True}, {"port": PLAIN}]})
    _segment_probe(run)
    client = in_netns(ns, lambda: exchange(SEG))
    in_netns(ns, lambda: exchange(PLAIN))
    segs, drained = _finish(run)
    assert segs and {(l["sport"], l["dport"]) for l in segs} <= {(SEG, client), (client, SEG)}, segs
    server = [l for l in segs if l["sport"] == SEG]
    assert sum(l["length"] for l in server) == SENDS * SIZE, server
    # each send a segment of its own; a line stands for those the kernel
    # joined (a busy socket's backlog, where a pure ACK may lead them) and
    # says how many: tcpi_segs_in's count
    assert all(l["length"] % SIZE == 0 and l["length"] <= SIZE * l["segs"] for l in server), server
    assert sum(l["segs"] for l in server if l["length"]) >= SENDS
    answers = [l for l in segs if l["sport"] == client]
    assert sum(l["length"] for l in answers) == ANSWERS, answers
    conn_ids = {l["conn_id"] for l in segs}
    assert len(conn_ids) == 2 and 0 not in conn_ids
    for l in segs:
        assert l["snd_cwnd"] > 0 and l["rcv_wnd"] > 0 and l["snd_wnd"] > 0 and l["segs"] >= 1, l
        assert (l["family"], l["saddr"], l["daddr"]) == ("ipv4", "127.0.0.1", "127.0.0.1"), l
    data = sorted((l["seq"], l["length"]) for l in server if l["length"])
    assert all(a + n == b for (a, n), (b, _) in zip(data, data[1:])), data     # in order, none twice
    assert drained["segments"] == len(segs) and run.drops()["segments"] == 0


def test_a_process_target_records_its_segments(nettap_run, mode, ns):
    """A task target with segments on: decided in the owner's task (its
    connect, its accept), where the socket alone would not say."""
    run = nettap_run({"captures": [{"pid": os.getpid(), "segments": True}]})
    _segment_probe(run)
    client = in_netns(ns, lambda: exchange(SEG))
    segs, _ = _finish(run)
    mine = [l for l in segs if {l["sport"], l["dport"]} == {SEG, client}]
    assert sum(l["length"] for l in mine if l["sport"] == SEG) == SENDS * SIZE, mine
    assert sum(l["length"] for l in mine if l["sport"] == client) == ANSWERS, mine


def test_no_segment_recorded_without_a_target_that_asks(nettap_run, mode, ns):
    """No target asks: tcp_segment is not even attached (capture.records), so
    no segment of the node runs it; none recorded."""
    run = nettap_run({"captures": [{"port": SEG}]})
    st = run.app.probes.separate["tcp_segment"]
    assert (st.reported, st.attached) in (("disabled", False), ("unsupported", False)), st
    in_netns(ns, lambda: exchange(SEG))
    segs, drained = _finish(run)
    assert segs == [] and drained["segments"] == 0
