"""Kernel tests: the request sockets of captured listeners (bpf/request.bpf.c),
from the SYN that makes one to its end: established, timed out, an overflow
(its ACK came while the accept queue was full), reset; on the loopback of a
network namespace of the test's own, its nftables rules dropping the
handshake's ACKs (test_retransmit.py's drop) and its
net.ipv4.tcp_synack_retries 1, so a request times out in 3 s (1 s, then
2 s after its SYN-ACK sent again)."""
import os
import socket
import struct
import subprocess
import time

import pytest

from procs import wait_for
from test_retransmit import drop, mib
from traffic import in_netns, listener

pytestmark = pytest.mark.per_variant
PORT, CPORT = 9000, 9300
# A SYN cookie's socket has its peer set after its birth (inet_sock_set_state) on 5.10, 6.1 and
# 6.12, the matrix's guests saw (its record's peer is 0 there: capture.md), before it on 6.18
COOKIE_PEER_UNSET = tuple(int(x) for x in os.uname().release.split(".")[:2]) <= (6, 12)


def _rows(run) -> dict:
    from exporter.kernel import tcp_h
    obs = run.obs_counts()
    return {name: int(obs[tcp_h.OBS_REQUESTS + n]) for n, name in tcp_h.NAMES["REQ"].items()
            if obs[tcp_h.OBS_REQUESTS + n]}


def _skip_unattached(run):
    st = run.app.probes.separate["tcp_request"]
    if not st.attached:
        pytest.skip(f"tcp_request not attached: {st.mechanism} {st.error}")


def requests(run) -> dict:
    """client port -> the outcomes of its request's lines, in order."""
    lines, _ = run.finish()
    out = {}
    for l in lines:
        if l["type"] == "request":
            peer = "0.0.0.0" if l["outcome"] == "cookie" and COOKIE_PEER_UNSET else "127.0.0.1"
            assert (l["conn_id"], l["pid"], l["daddr"]) == (0, 0, peer) and l["sport"] in (PORT, PORT + 1), l
            out.setdefault(l["dport"], []).append(l)
    return lines, out


def test_a_request_made_then_established(nettap_run, mode, ns):
    """Three connections to a captured listener: each request made as its
    SYN comes, established as its ACK does; none of a port not captured."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)

    def scenario():
        lsn, other = listener(PORT), listener(PORT + 1)
        ports = []
        for port in (PORT, PORT, PORT, PORT + 1):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            (lsn if port == PORT else other).accept()[0].close()
            ports.append(c.getsockname()[1])
            c.close()
        lsn.close()
        other.close()
        return ports[:3]
    ports = in_netns(ns, scenario)
    lines, got = requests(run)
    assert set(got) == set(ports), got
    for port in ports:
        made, ended = got[port]
        assert (made["outcome"], ended["outcome"]) == ("made", "established"), got[port]
        assert made["timeout_jiffies"] > 0 and ended["timeout_jiffies"] > 0 and made["retransmits"] == 0
        assert ended["age_ms"] < 1000 and made["netns"] == ended["netns"] > 0
    assert _rows(run) == {"made": 3, "established": 3}


def test_requests_time_out_overflow_and_reset(nettap_run, mode, ns):
    """The handshake's ACKs dropped: one client's request times out after its
    SYN-ACK sent once again (tcp_synack_retries 1); another's is reset by its
    client (SO_LINGER 0). And a listener with a backlog of 1 that never
    accepts: one connection queued, a second's request waits (its ACKs
    dropped), a third fills the accept queue (by a request, or where the
    kernel counts the request queue full at the backlog (5.10), by a SYN
    cookie: no request socket, its socket made as its ACK comes), then the
    second's ACK comes with the SYN-ACK sent again and finds the queue full:
    it times out, an overflow. The listener's drops (sk_drops): that ACK
    twice (tcp_listendrop, then the segment discarded) and the reset."""
    run = nettap_run({"captures": [{"port": PORT}, {"port": PORT + 1}]})
    _skip_unattached(run)
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_synack_retries=1"], check=True)
    drop(ns, "tcp flags & (syn | ack | rst) == ack")            # every handshake-ending ACK, to PORT
    script = ("table inet nettap_test2 {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
              f"  tcp sport {CPORT} tcp flags & (syn | ack | rst) == ack drop\n }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script.encode(), check=True)

    def scenario():
        lsn, full = listener(PORT), listener(PORT + 1, backlog=1)
        timeout = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        reset = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        queued = socket.create_connection(("127.0.0.1", PORT + 1), timeout=10)
        waiting = socket.create_connection(("127.0.0.1", PORT + 1), timeout=10, source_address=("127.0.0.1", CPORT))
        cookie = socket.create_connection(("127.0.0.1", PORT + 1), timeout=10)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()                                            # its RST reaches the request
        subprocess.run(["nft", "delete", "table", "inet", "nettap_test2"], check=True)
        start = time.monotonic()
        wait_for(lambda: _rows(run).get("timeout", 0) + _rows(run).get("overflow", 0) >= 2, timeout=20,
                 what="the requests' timeouts")
        took = time.monotonic() - start
        ports = [s.getsockname()[1] for s in (timeout, queued, cookie)]
        for s in (timeout, queued, waiting, cookie, lsn, full):
            s.close()
        return took, ports
    took, (t_port, q_port, c_port) = in_netns(ns, scenario)
    lines, got = requests(run)
    outcomes = {p: [l["outcome"] for l in ls] for p, ls in got.items()}
    resets = [p for p, o in outcomes.items() if o == ["made", "reset"]]
    cookie = outcomes.pop(c_port, [])
    assert cookie in (["cookie"], ["made", "established"]), cookie
    assert len(outcomes) == 4 and len(resets) == 1, sorted(outcomes.items())
    assert (outcomes[t_port], outcomes[q_port], outcomes[CPORT]) == \
        (["made", "timeout"], ["made", "established"], ["made", "overflow"]), outcomes
    for port in (t_port, CPORT):
        assert got[port][1]["retransmits"] == 1 and 2500 <= got[port][1]["age_ms"] <= 6000, got[port]
    more = len(cookie) // 2
    assert _rows(run) == {"made": 4 + more, "established": 1 + more, "timeout": 1, "overflow": 1, "reset": 1,
                          "listen_drop": 3, **({"cookie": 1} if not more else {})}
    assert took < 8, took


def _checksum(data: bytes) -> int:
    data += b"\0" * (len(data) % 2)
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _syn_again(cap: socket.socket) -> None:
    """Send again the first SYN to PORT that cap (AF_PACKET, on lo) sees, its
    TCP checksum made whole (loopback leaves it partial): the client's SYN
    sent again, at once rather than at its own retransmission timer's 1 s,
    which the request's timer matches (the two may fire together)."""
    while True:
        frame = bytearray(cap.recv(2048))
        ip = frame[14:]
        ihl = (ip[0] & 15) * 4
        if frame[12:14] == b"\x08\x00" and ip[9] == 6 and int.from_bytes(ip[ihl + 2:ihl + 4], "big") == PORT \
                and ip[ihl + 13] == 0x02:
            break
    tcp = bytearray(ip[ihl:int.from_bytes(ip[2:4], "big")])
    tcp[16:18] = b"\0\0"
    tcp[16:18] = _checksum(bytes(ip[12:20]) + struct.pack("!BBH", 0, 6, len(tcp)) + bytes(tcp)).to_bytes(2, "big")
    cap.send(bytes(frame[:14 + ihl]) + bytes(tcp))


def test_a_syn_sent_again_restarts_its_request(nettap_run, mode, ns):
    """The SYN-ACK dropped at the client, its SYN comes again 0.4 s later:
    tcp_check_req sends the SYN-ACK again and moves the request's timer
    (timer_cancel, then timer_start, the request still hashed), a restart,
    not an end; then the SYN-ACKs let through: one request, made once and
    established, no reset."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    drop(ns, "tcp flags & (syn | ack) == syn | ack", way="sport")    # the SYN-ACKs, at the client's input
    for name in ("accept_local", "route_localnet"):           # a frame sent on lo is routed: 127.0.0.1 let in
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.lo.{name}=1"], check=True)

    def scenario():
        lsn = listener(PORT)
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        cap.bind(("lo", 0))
        cap.settimeout(5)
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", PORT))
        time.sleep(0.4)
        _syn_again(cap)
        time.sleep(0.2)
        subprocess.run(["nft", "delete", "table", "inet", "nettap_test"], check=True)
        c.setblocking(True)
        c.settimeout(10)
        wait_for(lambda: c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 and _connected(c), timeout=10,
                 what="the handshake")
        lsn.accept()[0].close()
        port = c.getsockname()[1]
        for s in (c, cap, lsn):
            s.close()
        return port
    port = in_netns(ns, scenario)
    lines, got = requests(run)
    outcomes = [l["outcome"] for l in got.get(port, [])]
    assert outcomes == ["made", "established"], got
    assert got[port][1]["retransmits"] >= 1, got[port]
    # the listener's drops (sk_drops): each SYN sent again to the request (ours at 0.4 s, the client's own at
    # 1 s, before the request's timer at 1.4 s), which tcp_check_req answers and discards
    assert _rows(run) == {"made": 1, "established": 1, "listen_drop": 2}


def _connected(s: socket.socket) -> bool:
    try:
        s.getpeername()
        return True
    except OSError:
        return False


def test_a_deferred_request_that_times_out_is_no_overflow(nettap_run, mode, ns):
    """A TCP_DEFER_ACCEPT listener (1 s): its client's bare ACK is held back
    (tcp_check_req marks the request acked, as for an overflow), the client
    never sends, its ACKs after the first dropped: the request times out
    (tcp_synack_retries 1), a timeout, not an overflow (the queue is empty)."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_synack_retries=1"], check=True)

    def scenario():
        lsn = listener(PORT)
        lsn.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
        c = socket.create_connection(("127.0.0.1", PORT), timeout=10)    # its ACK held back
        time.sleep(0.1)
        drop(ns, "tcp flags & (syn | ack | rst) == ack")          # the ACKs to the SYN-ACK sent again
        wait_for(lambda: sum(_rows(run).get(o, 0) for o in ("timeout", "overflow", "established")) >= 1,
                 timeout=15, what="the deferred request's end")
        port = c.getsockname()[1]
        c.close()
        lsn.close()
        return port
    port = in_netns(ns, scenario)
    lines, got = requests(run)
    outcomes = [l["outcome"] for l in got.get(port, [])]
    if outcomes == ["made", "established"]:
        # the drop landed after the SYN-ACK was sent again at 1 s (nft under emulation: 5.10's guest
        # once), whose ACK completed the request: the case under test never happened
        pytest.skip("the ACKs' drop came after the SYN-ACK was sent again: no deferred timeout to see")
    assert outcomes == ["made", "timeout"], got
    # the listener's drops (sk_drops): the bare ACK held back, which tcp_check_req discards
    assert _rows(run) == {"made": 1, "timeout": 1, "listen_drop": 1}


def _sysctl(ns: str, name: str, value) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{name}={value}"], check=True)


def _mib_delta(before: dict, *names) -> dict:
    now = mib()
    return {n: now[n] - before[n] for n in names}


def test_syns_dropped_by_a_full_accept_queue_are_counted(nettap_run, mode, ns):
    """net.ipv4.tcp_syncookies 0, a listener with a backlog of 1 that never
    accepts: two connections fill its accept queue, then three SYNs are
    dropped (no request socket: LISTEN_OVERFLOWS, tcp_listendrop). Their
    clients close before their SYNs are sent again (1 s), so each is dropped
    once; nettap counts the listener's own count of them as it closes:
    listen_drop 3, as the kernel's TcpExtListenDrops."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    _sysctl(ns, "net.ipv4.tcp_syncookies", 0)

    def scenario():
        lsn = listener(PORT, backlog=1)
        before = mib()
        queued = [socket.create_connection(("127.0.0.1", PORT), timeout=10) for _ in range(2)]
        time.sleep(0.05)                                # the second's ACK made its socket
        dropped = []
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", PORT))
            dropped.append(c)
        time.sleep(0.3)
        for c in dropped:                               # in SYN_SENT: closed without a segment
            c.close()
        lsn.close()
        for c in queued:
            c.close()
        return _mib_delta(before, "ListenDrops", "ListenOverflows", "SyncookiesSent")
    kernel = in_netns(ns, scenario)
    assert kernel == {"ListenDrops": 3, "ListenOverflows": 3, "SyncookiesSent": 0}, kernel
    lines, got = requests(run)
    assert sorted(l["outcome"] for ls in got.values() for l in ls) == ["established"] * 2 + ["made"] * 2, got
    assert _rows(run) == {"made": 2, "established": 2, "listen_drop": 3}


def _cookie_lines(got: dict) -> list:
    return [l for ls in got.values() for l in ls if l["outcome"] == "cookie"]


def test_syns_answered_by_syn_cookies_are_counted(nettap_run, mode, ns):
    """net.ipv4.tcp_syncookies 2: every SYN answered with a SYN cookie, no
    request socket; each client's ACK brings the cookie back and the kernel
    makes its socket from it: cookie, one each, with the listener's port, as
    the kernel's TcpExtSyncookiesRecv counts."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    _sysctl(ns, "net.ipv4.tcp_syncookies", 2)

    def scenario():
        lsn = listener(PORT)
        before = mib()
        clients = [socket.create_connection(("127.0.0.1", PORT), timeout=10) for _ in range(3)]
        for c in clients:
            c.sendall(b"x")                            # the ACK came before it: the socket is made
            s, _ = lsn.accept()
            assert s.recv(1) == b"x"
            s.close()
        ports = sorted(c.getsockname()[1] for c in clients)
        for c in clients + [lsn]:
            c.close()
        return ports, _mib_delta(before, "SyncookiesSent", "SyncookiesRecv", "SyncookiesFailed")
    ports, kernel = in_netns(ns, scenario)
    assert kernel == {"SyncookiesSent": 3, "SyncookiesRecv": 3, "SyncookiesFailed": 0}, kernel
    lines, got = requests(run)
    cookies = _cookie_lines(got)
    assert len(cookies) == 3 and all(l["sport"] == PORT and l["age_ms"] == 0 for l in cookies), cookies
    assert sorted(l["dport"] for l in cookies) == ([0] * 3 if COOKIE_PEER_UNSET else ports), (ports, cookies)
    assert _rows(run) == {"cookie": 3}


def test_a_full_syn_queue_answers_with_cookies(nettap_run, mode, ns):
    """net.ipv4.tcp_syncookies 1, a listener with a backlog of 2 that accepts
    at once, the handshake's ACKs dropped: five SYNs, the first ones make
    request sockets until the SYN queue is full (3 on Linux 6.x, whose queue
    is full above the backlog; 2 on 5.10, at it), the others are answered
    with cookies. The ACKs then let through (each client's first data):
    every request established, every cookie made into a socket."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    _sysctl(ns, "net.ipv4.tcp_syncookies", 1)
    drop(ns, "tcp flags & (syn | ack | rst) == ack")            # the ACKs (and data) to PORT

    def scenario():
        lsn = listener(PORT, backlog=2)
        before = mib()
        clients = []
        for _ in range(5):
            c = socket.socket()
            c.settimeout(10)
            c.connect(("127.0.0.1", PORT))                      # its SYN-ACK came: its ACK dropped
            clients.append(c)
        subprocess.run(["nft", "delete", "table", "inet", "nettap_test"], check=True)
        for c in clients:
            c.sendall(b"x")
            s, _ = lsn.accept()
            assert s.recv(1) == b"x"
            s.close()
        for c in clients + [lsn]:
            c.close()
        return _mib_delta(before, "SyncookiesSent", "SyncookiesRecv", "TCPReqQFullDoCookies")
    kernel = in_netns(ns, scenario)
    cookies = kernel["SyncookiesSent"]
    assert 1 <= cookies <= 3 and kernel == {"SyncookiesSent": cookies, "SyncookiesRecv": cookies,
                                            "TCPReqQFullDoCookies": cookies}, kernel
    lines, got = requests(run)
    assert len(_cookie_lines(got)) == cookies
    assert _rows(run) == {"made": 5 - cookies, "established": 5 - cookies, "cookie": cookies}


def test_a_syn_whose_syn_acks_are_dropped_times_out(nettap_run, mode, ns):
    """net.ipv4.tcp_synack_retries 2, the SYN-ACKs dropped at the client's
    input and, once the first SYN is in, the client's own SYNs sent again
    (each would make the listener send its SYN-ACK again at once): the
    request's timer sends the SYN-ACK again twice, at 1 s and 3 s, and drops
    it at 7 s: timeout, 2 retransmits."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    _sysctl(ns, "net.ipv4.tcp_synack_retries", 2)
    drop(ns, "tcp flags & (syn | ack) == syn | ack", way="sport")    # the SYN-ACKs, at the client's input

    def scenario():
        lsn = listener(PORT)
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", PORT))
        time.sleep(0.2)
        script = ("table inet nettap_test_syn {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
                  f"  tcp dport {PORT} tcp flags & (syn | ack) == syn drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=script.encode(), check=True)
        start = time.monotonic()
        wait_for(lambda: _rows(run).get("timeout"), timeout=20, what="the request's timeout")
        took = time.monotonic() - start
        port = c.getsockname()[1]
        c.close()
        lsn.close()
        return port, took
    port, took = in_netns(ns, scenario)
    lines, got = requests(run)
    assert [l["outcome"] for l in got.get(port, [])] == ["made", "timeout"], got
    ended = got[port][1]
    assert ended["retransmits"] == 2 and 6500 <= ended["age_ms"] <= 12000, ended
    assert _rows(run) == {"made": 1, "timeout": 1} and took < 12, took
