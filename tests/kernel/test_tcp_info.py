"""Kernel tests: the kernel as a check of nettap's counts. For every captured
connection, each side's own TCP_INFO (getsockopt, read once the side has
reached TCP_CLOSE with its descriptor still open, so nothing changes after)
against what nettap published for it: the destroy line's totals, the eof
line's bytes moved by captured calls, one retransmit line per segment the
kernel counts as sent again, and segment lines (tcp:tcp_probe) whose `segs`
add up to the segments it counts received established (tcpi_segs_in). Clean
connections and lossy ones (nftables drops on the loopback of a network
namespace of the test's own, as test_retransmit.py's)."""
import socket
import struct
import subprocess
import threading
import time
from collections import Counter

from conftest import live_conn_ids
from procs import wait_for
from test_retransmit import drop
from traffic import in_netns, listener, payload

PORT = 9000
TCP_CLOSE = 7
# struct tcp_info (include/uapi/linux/tcp.h), as far as tcpi_segs_in: 8 bytes
# of u8 fields, 23 u32 skipped (tcpi_rto .. tcpi_rcv_space), tcpi_total_retrans, 4 u64 (pacing rates,
# tcpi_bytes_acked, tcpi_bytes_received), 2 u32 (tcpi_segs_out, tcpi_segs_in).
TCP_INFO = struct.Struct("=B7x92xI4Q2I")


def tcp_info(s: socket.socket) -> dict:
    raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO.size)
    state, total_retrans, _, _, acked, received, segs_out, segs_in = TCP_INFO.unpack(raw[:TCP_INFO.size])
    return {"state": state, "total_retrans": total_retrans, "bytes_acked": acked,
            "bytes_received": received, "segs_out": segs_out, "segs_in": segs_in}


def unacked(s: socket.socket) -> int:
    """tcpi_unacked: the fifth u32 after the 8 bytes of u8 fields."""
    return struct.unpack_from("=I", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 28), 24)[0]


def quiet_info(s: socket.socket, both: threading.Barrier) -> tuple:
    """Once this side's data is all acknowledged and the other side's too
    (both at the barrier): (CLOCK_MONOTONIC ns, TCP_INFO) of this side, read
    while nothing is in flight; then the barrier again, so neither side
    sends until both have read."""
    wait_for(lambda: unacked(s) == 0, timeout=30, what="its data acknowledged")
    both.wait(30)
    info = tcp_info(s)
    at = time.monotonic_ns()
    both.wait(30)
    return at, info


def conversation(sends: int, size: int, answer: int) -> tuple:
    """A client on PORT sends, once the server has accepted, `sends` x `size`
    bytes (TCP_NODELAY: a segment each up to the MSS), the server answers `answer` bytes once it has them
    all; each side then shuts its sending half, the client first, reads the
    other's FIN and waits for TCP_CLOSE (the client's socket reaches it as
    its TIME_WAIT socket takes over, the server's at the client's last ACK).
    Returns (port, TCP_INFO, quiet) of each side, client first, TCP_INFO
    read at TCP_CLOSE, quiet (when, TCP_INFO) read while both sides were
    established and nothing was in flight, after the answer."""
    lsn = listener(PORT)
    got = {}
    both = threading.Barrier(2)
    accepted = threading.Event()

    def serve():
        s, _ = lsn.accept()
        accepted.set()
        n = 0
        while n < sends * size:
            n += len(s.recv(65536))
        s.sendall(payload(answer))
        quiet = quiet_info(s, both)
        assert s.recv(1) == b""                 # the client's FIN
        s.shutdown(socket.SHUT_WR)
        wait_for(lambda: tcp_info(s)["state"] == TCP_CLOSE, timeout=30, what="the server at TCP_CLOSE")
        got["server"] = (s.getsockname()[1], tcp_info(s), quiet)
        s.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # the server's socket made before the first byte goes: a data segment
    # that races the handshake's last ACK to the request (another CPU) can
    # make the socket itself, its bytes taken in SYN_RECV (no tcp_probe:
    # seen in the 5.10 guest)
    assert accepted.wait(30)
    for i in range(sends):
        c.sendall(payload(size, seed=i))
    n = 0
    while n < answer:
        n += len(c.recv(65536))
    quiet = quiet_info(c, both)
    c.shutdown(socket.SHUT_WR)
    assert c.recv(1) == b""                     # the server's FIN
    wait_for(lambda: tcp_info(c)["state"] == TCP_CLOSE, timeout=30, what="the client at TCP_CLOSE")
    client = (c.getsockname()[1], tcp_info(c), quiet)
    c.close()
    t.join(30)
    lsn.close()
    return client, got["server"]


# Segments each side received before it was established, which tcp:tcp_probe
# (tcp_rcv_established) does not see and tcpi_segs_in counts: the client's
# SYN-ACK; the server's SYN (counted as its socket is made) and the ACK that
# made it.
HANDSHAKE_IN = {False: 1, True: 2}


def check(run, conversations) -> Counter:
    """Every side of every conversation ((sends, size, answer), (client,
    server)) has nettap's lines equal to its TCP_INFO; returns the
    retransmissions counted, by cause. nettap's segment lines against
    tcpi_segs_in: read while quiet, the segments received then are the
    handshake's and those lines, every one; after, the server receives the
    client's FIN established (a line) and the last ACK in LAST_ACK, the
    client only segments of its FIN_WAIT states (the ACK of its FIN, the
    server's FIN: one segment or two, by the server's delayed ACK)."""
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket destroyed")
    lines, _ = run.finish()
    assert run.drops()["segments"] == 0
    # each side's connection by its client port, in the order of their ends: a
    # later conversation may get a port again, from the TIME_WAIT socket of an
    # earlier one (tcp_tw_reuse's default, 2, on loopback), once it has ended
    by_port = {}
    for l in sorted((l for l in lines if l["type"] == "destroy"), key=lambda l: l["ts_ns"]):
        key = l["sport"] if l["sport"] != PORT else l["dport"], l["sport"] == PORT
        by_port.setdefault(key, []).append(l["conn_id"])
    causes = Counter()
    for (sends, size, answer), ((cport, cinfo, cquiet), (_, sinfo, squiet)) in conversations:
        for server, info, quiet, sent, received in ((False, cinfo, cquiet, sends * size, answer),
                                                    (True, sinfo, squiet, answer, sends * size)):
            conn = by_port[(cport, server)].pop(0)
            mine = [l for l in lines if l["conn_id"] == conn]
            (d,) = [l for l in mine if l["type"] == "destroy"]
            assert {k: d[k] for k in info if k != "state"} == {k: v for k, v in info.items() if k != "state"}, \
                (server, d, info)
            (eof,) = [l for l in mine if l["type"] == "eof"]
            assert (eof["tx_bytes"], eof["rx_bytes"]) == (sent, received), (server, eof)
            retrans = [l["cause"] for l in mine if l["type"] == "retransmit"]
            assert len(retrans) == info["total_retrans"], (server, retrans, info)
            causes.update(retrans)
            at, then = quiet
            segs = [l for l in mine if l["type"] == "segment"]
            # a line stands for `segs` segments: more than one where the kernel
            # joined them (a pure ACK and the next, on the backlog of a socket
            # its owner held in sendmsg), counted so by tcpi_segs_in too
            before = sum(l["segs"] for l in segs if l["ts_ns"] <= at)
            assert then["segs_in"] == HANDSHAKE_IN[server] + before, (server, then, before)
            # every byte in them (and any segment sent twice, again)
            assert sum(l["length"] for l in segs if l["ts_ns"] <= at) >= received, (server, segs)
            assert sum(l["segs"] for l in segs) - before == (1 if server else 0), (server, segs, at)
            assert info["segs_in"] - then["segs_in"] in ((2,) if server else (1, 2)), (server, info, then)
    assert not any(by_port.values()), by_port    # no connection but the conversations'
    return causes


# (sends, size, answer): one segment each way; many segments each way; a
# request of several MSS (loopback's MSS is 65483: 70,000 bytes is two).
SHAPES = [(1, 100, 100), (20, 300, 5000), (1, 70000, 200)]


def test_nettaps_counts_equal_the_kernels_own(nettap_run, mode, ns):
    """Clean connections of three shapes: every count equal to TCP_INFO's. No
    segment is lost, but a loaded host may delay an ACK past the loss probe's
    time (a spurious probe, which both count): no retransmission but those."""
    run = nettap_run({"captures": [{"port": PORT, "segments": True}]})
    done = [(shape, in_netns(ns, lambda s=shape: conversation(*s))) for shape in SHAPES]
    assert set(check(run, done)) <= {"tlp"}


def test_nettaps_counts_equal_the_kernels_own_when_segments_are_lost(nettap_run, mode, ns):
    """The same shapes with every third data segment each way lost (nftables
    on the namespace's input, ``numgen``): the kernel sends them again (loss
    probes, recovery on ACKs or its timer) and nettap has a retransmit line
    for each segment TCP_INFO counts, and the same totals."""
    run = nettap_run({"captures": [{"port": PORT, "segments": True}]})
    drop(ns, "ip length > 100 numgen inc mod 3 == 0")
    drop_sport = ("table inet nettap_test_out {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
                  f"  tcp sport {PORT} ip length > 100 numgen inc mod 3 == 1 drop\n }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=drop_sport.encode(), check=True,
                   capture_output=True)
    done = [(shape, in_netns(ns, lambda s=shape: conversation(*s))) for shape in SHAPES]
    causes = check(run, done)
    assert sum(causes.values()) >= 3, causes      # at least one loss per conversation
