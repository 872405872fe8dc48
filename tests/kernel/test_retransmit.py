"""Kernel tests: what captured sockets send again (bpf/retransmit.bpf.c) and
their retransmit and keepalive timers as they fire (bpf/timer.bpf.h), forced
by nftables drops on the loopback of a network namespace of the test's own
(netem is not built into every kernel; nftables is), and told apart by the
recovery that sent it. Each scenario drops a fixed pattern of packets
(``numgen inc``: counted from the table's creation), so what the kernel
retransmits is known in advance."""
import socket
import subprocess
import threading
import time
from collections import Counter

import pytest

from conftest import live_conn_ids
from procs import wait_for
from traffic import in_netns, listener

# Their programs are tp_btf whatever the call probes' mechanism (loader.SEPARATE):
# once per BPF variant, not once per mechanism.
pytestmark = pytest.mark.per_variant
PORT = 9000
DATA = b"r" * 200                 # one segment, told from handshake packets and ACKs by its length


def drop(ns: str, match: str = "", way: str = "dport") -> None:
    """Drop the packets to PORT (way sport: from it) that match as the namespace receives them (a
    fresh table: its numgen counters start at 0). On input, not output: a
    packet refused on output fails its send, which TCP sees and sends later
    as if new, no retransmission."""
    script = ("table inet nettap_test {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
              f"  tcp {way} {PORT} {match} drop\n }}\n}}\n")
    p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script.encode(), capture_output=True)
    assert p.returncode == 0, f"nft -f: rc {p.returncode}: {p.stderr.decode(errors='replace')}"


def mib() -> dict:
    """The TcpExt counters of the calling thread's network namespace."""
    with open("/proc/thread-self/net/netstat") as f:
        rows = [line.split() for line in f if line.startswith("TcpExt:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))


# The kernel's own count of each recovery (include/uapi/linux/snmp.h): a loss
# probe sent, an RTO, a segment sent again in fast recovery.
MIB_CAUSES = {"tlp": "TCPLossProbes", "rto": "TCPTimeouts", "fast": "TCPFastRetrans"}


def exchange(ns: str, sends: int = 1, timeout: float = 20) -> tuple:
    """In ns: a client sends DATA sends times (TCP_NODELAY: a segment each)
    to a server on PORT, which answers once it has it all; the client closes
    after the answer (no FIN while data is unacknowledged). Returns the
    client's port and the namespace's count of each recovery meanwhile (the
    kernel's, MIB_CAUSES)."""
    def run():
        before = mib()
        port = talk()
        after = mib()
        return port, Counter({c: after[n] - before[n] for c, n in MIB_CAUSES.items() if after[n] - before[n]})

    def talk():
        lsn = listener(PORT)

        def serve():
            c, _ = lsn.accept()
            with c:
                got = 0
                while got < sends * len(DATA):
                    got += len(c.recv(65536))
                c.sendall(b"ok")
                c.recv(1)
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        c = socket.create_connection(("127.0.0.1", PORT), timeout=timeout)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(sends):
            c.sendall(DATA)
        assert c.recv(2) == b"ok"
        port = c.getsockname()[1]
        c.close()
        t.join(timeout)
        lsn.close()
        return port
    return in_netns(ns, run)


def retransmits(run, sport: int) -> list:
    """(cause, state, retransmits) of the client's retransmit lines."""
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket closed")
    lines, _ = run.finish()
    out = [(l["cause"], l["state"], l["retransmits"]) for l in lines
           if l["type"] == "retransmit" and l["sport"] == sport]
    for l in lines:
        if l["type"] == "retransmit":
            assert l["dport"] == PORT and l["daddr"] == "127.0.0.1" and l["rto_jiffies"] > 0, l
    return out


def test_a_lost_tail_is_sent_again_by_a_loss_probe(nettap_run, mode, ns):
    """The one segment of a request is lost; the loss probe (TLP) sends it
    again before the retransmission timer would."""
    run = nettap_run({"captures": [{"port": PORT}]})
    drop(ns, "ip length > 100 numgen inc mod 2 == 0")        # the segment, not its probe
    sport, kernel = exchange(ns)
    assert retransmits(run, sport) == [("tlp", "ESTABLISHED", 0)]
    assert kernel == Counter(tlp=1)


def test_a_lost_probe_leaves_it_to_the_retransmission_timer(nettap_run, mode, ns):
    """The segment, its loss probe and the first timer retransmission are
    lost: the retransmission timer fires twice (RTOs, the kind tcp_retries2
    counts), its count of retransmissions in a row one more the second time.
    (Read as the segment is sent, the count is 0 or 1 at the first RTO: the
    kernel increments it before sending on some releases, after on others.)
    Once in some CI runs on a loaded host the first RTO's line was missing
    while the kernel counted both, and once a socket's entry outlived its
    close by a minute (neither reproduced in 36 runs on a quiet one): such a
    try is kept, with nettap's own counters, and the scenario run once more;
    a miss twice in a row fails with both."""
    tries = []
    for _ in range(2):
        run = nettap_run({"captures": [{"port": PORT}]})
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "nettap_test"],
                       capture_output=True)                  # a fresh table: numgen from 0 again
        drop(ns, "ip length > 100 numgen inc mod 4 < 3")     # the segment, the probe, the first RTO's
        sport, kernel = exchange(ns)
        try:
            got = retransmits(run, sport)
        except TimeoutError as e:                            # a socket's entry not gone: told below
            tries.append((str(e), kernel, run.obs_counts()[_row("RETRANS_RTO")], run.drops()))
            got = []
            continue
        obs = run.obs_counts()
        counted = (obs[_row("RETRANS_RTO")], obs[_row("RETRANS_TLP")], obs[_row("RETRANS_FAST")])
        tries.append((got, kernel, counted, run.drops()))
        # each as the kernel counted its recoveries (a timer that fires early is re-armed, not counted)
        if Counter(c for c, _, _ in got) == kernel:
            break
    assert Counter(c for c, _, _ in got) == kernel, tries
    assert [c for c, _, _ in got] == ["tlp", "rto", "rto"] and {s for _, s, _ in got} == {"ESTABLISHED"}, got
    first = got[1][2]
    assert got[0][2] == 0 and first in (0, 1) and got[2][2] == first + 1, got
    assert counted == (2, 1, 0), tries


def test_a_segment_lost_among_others_is_recovered_on_acks(nettap_run, mode, ns):
    """The first of eight segments sent back to back is lost; the peer's
    SACKs of the rest recover it (fast retransmit or RACK), not a timer."""
    run = nettap_run({"captures": [{"port": PORT}]})
    drop(ns, "ip length > 100 numgen inc mod 1000 == 0")     # the first only
    sport, kernel = exchange(ns, sends=8)
    got = retransmits(run, sport)
    # Where the SACKs come after the loss probe's time (an emulated CPU sends
    # the eight slowly), the probe recovers it, or the probe goes out and the
    # SACKs' fast retransmit follows (seen in the 6.1 guests under load): the
    # kernel's counters say which; never the retransmission timer.
    causes = Counter(c for c, _, _ in got)
    assert causes == kernel and set(causes) <= {"fast", "tlp"} and 1 <= len(got) <= 2, (got, kernel)
    assert all(g[1:] == ("ESTABLISHED", 0) for g in got)


def test_a_listener_sends_its_syn_ack_again_when_the_ack_is_lost(nettap_run, mode, ns):
    """The client's ACKs to a listener on a captured port are dropped: the
    listener's request times out (1 s) and it sends its SYN-ACK again. The
    request is no connection yet: conn_id and pid 0."""
    run = nettap_run({"captures": [{"port": PORT}]})
    drop(ns, "tcp flags & (syn | ack) == ack")               # every ACK without SYN
    lsn = in_netns(ns, lambda: listener(PORT))
    c = in_netns(ns, lambda: socket.create_connection(("127.0.0.1", PORT), timeout=10))
    sport = c.getsockname()[1]
    deadline = time.time() + 30
    while not run.obs_counts()[_row("RETRANS_SYNACK")] and time.time() < deadline:
        time.sleep(0.05)
    c.close()
    lsn.close()
    lines, _ = run.finish()
    mine = [l for l in lines if l["type"] == "synack_retransmit"]
    assert mine, "no SYN-ACK sent again in 30 s"
    first = mine[0]
    assert (first["sport"], first["dport"], first["daddr"], first["retransmits"]) == (PORT, sport, "127.0.0.1", 0)
    assert (first["conn_id"], first["pid"], first["family"]) == (0, 0, "ipv4")
    assert run.obs_counts()[_row("RETRANS_SYNACK")] == len(mine)   # the listener gone before: no more since


def _row(name: str) -> int:
    from exporter.kernel import tcp_h
    return tcp_h.OBS_RETRANS + getattr(tcp_h, name)


def _timers(lines, sport):
    return [l for l in lines if l["type"] == "timer" and l["sport"] == sport]


def test_the_retransmit_timer_fires_for_the_probe_then_the_rto(nettap_run, mode, ns):
    """The lost segment of a request: its socket's retransmit timer fires
    armed for a loss probe, then for an RTO, each within a few jiffies of its
    slot on the wheel (the wheel's own rounding aside)."""
    run = nettap_run({"captures": [{"port": PORT}]})
    if not _probe(run, "tcp_timer").attached:
        pytest.skip(f"tcp_timer not loaded: {_probe(run, 'tcp_timer').mechanism}")
    drop(ns, "ip length > 100 numgen inc mod 3 < 2")         # the segment and the probe
    sport, _ = exchange(ns)
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket closed")
    lines, _ = run.finish()
    fired = [(l["timer"], l["event"]) for l in _timers(lines, sport)]
    # a timer that fires before its time (re-armed, icsk_timeout later) is seen twice
    assert [e for i, e in enumerate(fired) if i == 0 or e != fired[i - 1]] == \
        [("retransmit", "loss_probe"), ("retransmit", "rto")], fired
    for l in _timers(lines, sport):
        assert 0 <= l["behind_jiffies"] < 1000 and l["owned"] in (0, 1) and l["state"] == "ESTABLISHED", l
        assert (l["dport"], l["daddr"]) == (PORT, "127.0.0.1")


def test_keepalives_to_a_silent_peer_fire_the_keepalive_timer(nettap_run, mode, ns):
    """A client with keepalives every second whose peer stops answering: its
    keepalive timer fires each second until the connection times out
    (ETIMEDOUT where the kernel reports errors). The timer is sk_timer, or
    icsk_keepalive_timer where the kernel has it (Debian's 6.1 and 6.12)."""
    run = nettap_run({"captures": [{"port": PORT}]})
    if not _probe(run, "tcp_timer").attached:
        pytest.skip(f"tcp_timer not loaded: {_probe(run, 'tcp_timer').mechanism}")
    lsn = in_netns(ns, lambda: listener(PORT))

    c = in_netns(ns, lambda: socket.create_connection(("127.0.0.1", PORT), timeout=10))
    sport = c.getsockname()[1]
    before = in_netns(ns, mib)["TCPKeepAlive"]
    # the server's ACKs to the keepalives, dropped before the first is sent (an ACKed one
    # would set icsk_probes_out back to 0)
    drop(ns, way="sport")
    for opt, v in ((socket.TCP_KEEPIDLE, 1), (socket.TCP_KEEPINTVL, 1), (socket.TCP_KEEPCNT, 2)):
        c.setsockopt(socket.IPPROTO_TCP, opt, v)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    deadline = time.time() + 30
    while c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 and time.time() < deadline:
        time.sleep(0.1)
    kernel = in_netns(ns, mib)["TCPKeepAlive"] - before
    c.close()
    lsn.close()
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket closed")
    lines, _ = run.finish()
    keep = [l for l in _timers(lines, sport) if l["timer"] == "keepalive"]
    assert len(keep) >= 2 and {l["event"] for l in keep} == {"none"}, keep
    assert all(l["state"] == "ESTABLISHED" and l["behind_jiffies"] < 1000 for l in keep), keep
    if _probe(run, "tcp_timer_exit").attached:             # each keepalive sent: a probe record
        probes = [l for l in lines if l["type"] == "probe" and l["sport"] == sport]
        assert kernel >= 2 and len(probes) == kernel, (probes, kernel)
        assert [l["probe"] for l in probes] == ["keepalive"] * kernel, probes
        assert [l["probes_out"] for l in probes] == list(range(1, kernel + 1)), probes


def _probe(run, name):
    return run.app.probes.separate[name]


def test_a_zero_window_is_probed_by_the_retransmit_timer(nettap_run, mode, ns):
    """A server that never reads: the client fills its window, and its
    retransmit timer, armed for a zero-window probe, sends one probe after
    another (the peer answers each with its window still 0). Each is a probe
    record, as many as the kernel counted (TcpExt TCPWinProbe)."""
    run = nettap_run({"captures": [{"port": PORT}]})
    for name in ("tcp_timer", "tcp_timer_exit"):
        if not _probe(run, name).attached:
            pytest.skip(f"{name} not loaded: {_probe(run, name).mechanism}")

    def stall():
        lsn = listener(PORT, rcvbuf=4096)
        c = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        s, _ = lsn.accept()
        before = mib()["TCPWinProbe"]
        c.setblocking(False)
        try:
            while True:
                c.send(DATA * 20)
        except BlockingIOError:
            pass
        deadline = time.time() + 30
        while mib()["TCPWinProbe"] - before < 3 and time.time() < deadline:
            time.sleep(0.05)
        s.close()                       # unread data: a reset, the client's probes end
        wait_for(lambda: c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or True, what="the reset")
        sport = c.getsockname()[1]
        time.sleep(0.2)
        c.close()
        lsn.close()
        return sport, mib()["TCPWinProbe"] - before
    sport, kernel = in_netns(ns, stall)
    assert kernel >= 3, "the kernel sent fewer than 3 zero-window probes in 30 s"
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket closed")
    lines, _ = run.finish()
    probes = [l for l in lines if l["type"] == "probe" and l["sport"] == sport]
    assert len(probes) == kernel, (probes, kernel)
    for l in probes:
        assert (l["probe"], l["snd_wnd"], l["state"], l["dport"]) == ("window", 0, "ESTABLISHED", PORT), l
        assert l["probes_out"] >= 1 and l["rto_jiffies"] > 0 and l["conn_id"] > 0, l
    windows = [l for l in _timers(lines, sport) if l["event"] == "probe0"]
    assert len(windows) >= len(probes), windows
    from exporter.kernel import tcp_h
    assert run.obs_counts()[tcp_h.OBS_WAKEUPS + tcp_h.WAKEUP_WINDOW] == kernel
