"""Kernel tests: captured connections' TIME_WAIT sockets (bpf/timewait.bpf.c),
made as the connection closes and ended by their timer, a reset, new data or
a new connection taking their tuple, on the loopback of a network namespace
of the test's own (its sysctls its own). A TIME_WAIT socket of the full 60 s
is not waited out here (the kernel's TCP_TIMEWAIT_LEN, no sysctl shortens
it): its expiry is tested on one half-closed (substate FIN_WAIT2), whose
timer is net.ipv4.tcp_fin_timeout's, 1 s here, and which the same timer
program ends."""
import socket
import struct
import subprocess
import threading
import time

import pytest

from conftest import live_conn_ids, own_netns
from procs import wait_for
from traffic import in_netns, listener

# tp_btf whatever the call probes' mechanism: once per BPF variant.
pytestmark = pytest.mark.per_variant
PORT, CPORT = 9000, 9200
HZ_MIN = 100                     # the kernel's HZ is 100 to 1000: 60 s is 6,000 jiffies or more


def sysctl(ns: str, name: str, value) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{name}={value}"], check=True)


def timewait_lines(run, sport: int) -> list:
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket destroyed")
    lines, _ = run.finish()
    return lines, [l for l in lines if l["type"] == "timewait" and l["sport"] == sport]


def _tw_rows(run) -> dict:
    from exporter.kernel import tcp_h
    obs = run.obs_counts()
    names = {**tcp_h.NAMES["TW"], 0: "untied"}         # row 0: not tied (bpf/timewait.bpf.h TW_UNTIED)
    return {name: int(obs[tcp_h.OBS_TIMEWAIT + n]) for n, name in names.items() if obs[tcp_h.OBS_TIMEWAIT + n]}


def _skip_unattached(run):
    st = run.app.probes.separate["tcp_timewait"]
    if not st.attached:
        pytest.skip(f"tcp_timewait not attached: {st.mechanism} {st.error}")


def connect_from(port: int) -> socket.socket:
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("127.0.0.1", port))
    c.connect(("127.0.0.1", PORT))
    return c


def test_a_time_wait_socket_taken_over_by_a_new_connection(nettap_run, mode, ns):
    """The client closes first: its connection's TIME_WAIT socket (60 s) is
    made as its socket closes, tied to its conn_id; a new connection from
    the same port to the same server takes its tuple over (a bound connect
    reuses a TIME_WAIT socket whose peer sent timestamps): reused."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)

    def scenario():
        lsn = listener(PORT)
        c = connect_from(CPORT)
        s, _ = lsn.accept()
        c.sendall(b"x")
        assert s.recv(1) == b"x"
        c.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""
        s.close()
        assert c.recv(1) == b""
        wait_for(lambda: _state(c) == 7, timeout=10, what="the client at TCP_CLOSE")
        c.close()
        again = connect_from(CPORT)               # takes the TIME_WAIT socket's tuple
        s2, _ = lsn.accept()
        for sock in (again, s2):                  # gone by a reset: no TIME_WAIT socket of theirs
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        lsn.close()
    in_netns(ns, scenario)
    lines, tw = timewait_lines(run, CPORT)
    first = [l for l in lines if l["type"] == "eof" and l["sport"] == CPORT]
    assert [(l["event"], l["substate"]) for l in tw] == [("made", "TIME_WAIT"), ("reused", "TIME_WAIT")], tw
    made, ended = tw
    assert made["conn_id"] == ended["conn_id"] == first[0]["conn_id"] and made["conn_id"] > 0
    assert made["timeout_jiffies"] >= 60 * HZ_MIN and made["age_ms"] == 0, made
    assert 0 < ended["timeout_jiffies"] <= made["timeout_jiffies"] and ended["age_ms"] < 10000, ended
    for l in tw:
        assert (l["dport"], l["daddr"], l["saddr"], l["pid"]) == (PORT, "127.0.0.1", "127.0.0.1", made["pid"]), l
    assert _tw_rows(run) == {"made": 1, "reused": 1}


def _state(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def in_time_wait(port: int) -> bool:
    """The local port's socket is a TIME_WAIT one, in this thread's netns: its
    row's timer is 3 (get_timewait4_sock; st is its substate, as a socket's)."""
    with open("/proc/thread-self/net/tcp") as f:
        rows = [l.split() for l in list(f)[1:]]
    return any(int(r[1].rsplit(":", 1)[1], 16) == port and r[5].startswith("03:") for r in rows)


def half_closed(ns: str, then) -> int:
    """The client closes while the server keeps its end open: the client's
    TIME_WAIT socket is a half-closed one (FIN_WAIT2), waiting for the
    server's FIN. then(server socket) runs next; returns the client's port."""
    def scenario():
        lsn = listener(PORT)
        c = connect_from(CPORT + 1)
        s, _ = lsn.accept()
        c.close()                                  # its FIN acknowledged: a FIN_WAIT2 TIME_WAIT socket
        assert s.recv(1) == b""
        then(s)
        s.close()
        lsn.close()
        return CPORT + 1
    return in_netns(ns, scenario)


def test_a_reset_kills_a_time_wait_socket(nettap_run, mode, ns):
    """A half-closed TIME_WAIT socket receives the server's reset (its close
    with SO_LINGER 0): killed, cause reset. Another receives new data, which
    it answers with a reset of its own: killed, reset too."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)

    def abort(s):
        # the client's socket closed, its TIME_WAIT socket made as the server's ACK came (a
        # guest's softirq may come late: data to a FIN_WAIT2 socket is reset, with no TIME_WAIT)
        wait_for(lambda: in_time_wait(CPORT + 1), timeout=10, what="the client's TIME_WAIT socket")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sport = half_closed(ns, abort)
    lines, tw = timewait_lines(run, sport)
    assert [(l["event"], l["substate"]) for l in tw] == [("made", "FIN_WAIT2"), ("reset", "FIN_WAIT2")], tw
    assert tw[0]["conn_id"] == tw[1]["conn_id"] > 0
    assert _tw_rows(run) == {"made": 1, "reset": 1}

    run = nettap_run({"captures": [{"port": PORT}]})

    def data(s):
        wait_for(lambda: in_time_wait(CPORT + 1), timeout=10, what="the client's TIME_WAIT socket")
        s.sendall(b"late")
        wait_for(lambda: s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or _state(s) == 7, timeout=10,
                 what="the client's reset")
    sport = half_closed(ns, data)
    lines, tw = timewait_lines(run, sport)
    assert [(l["event"], l["substate"]) for l in tw] == [("made", "FIN_WAIT2"), ("reset", "FIN_WAIT2")], tw
    assert _tw_rows(run) == {"made": 1, "reset": 1}


def test_a_half_closed_time_wait_socket_expires(nettap_run, mode, ns):
    """With net.ipv4.tcp_fin_timeout 1 s, a half-closed TIME_WAIT socket
    whose peer never closes expires after about a second: expired, no
    time left, and the counters say so."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    sysctl(ns, "net.ipv4.tcp_fin_timeout", 1)
    done = {}

    def wait(s):
        wait_for(lambda: _tw_rows(run).get("expired"), timeout=10, what="its expiry")
        done["at"] = time.monotonic()
    start = time.monotonic()
    sport = half_closed(ns, wait)
    lines, tw = timewait_lines(run, sport)
    assert [(l["event"], l["substate"]) for l in tw] == [("made", "FIN_WAIT2"), ("expired", "FIN_WAIT2")], tw
    made, ended = tw
    assert HZ_MIN <= made["timeout_jiffies"] <= 1000 + 10 and ended["timeout_jiffies"] == 0, tw
    assert 900 <= ended["age_ms"] <= 5000 and done["at"] - start < 6, tw
    assert _tw_rows(run) == {"made": 1, "expired": 1}


def test_sockets_not_captured_leave_no_time_wait_line(nettap_run, mode, ns):
    """A connection on a port no target names: its TIME_WAIT socket is made
    and reused as above, and nettap neither follows nor counts it."""
    run = nettap_run({"captures": [{"port": PORT + 1}]})
    _skip_unattached(run)

    def scenario():
        lsn = listener(PORT)
        for _ in range(2):
            close_client_first(lsn, connect_from(CPORT + 2))
        lsn.close()
    in_netns(ns, scenario)
    lines, tw = timewait_lines(run, CPORT + 2)
    assert tw == [] and _tw_rows(run) == {}


def close_client_first(lsn, c) -> int:
    """c's connection, accepted by lsn, closed by the client's FIN first and
    the peer's FIN read: c's socket goes to TIME_WAIT. Returns c's port."""
    s, _ = lsn.accept()
    c.shutdown(socket.SHUT_WR)
    assert s.recv(1) == b""
    s.close()
    assert c.recv(1) == b""
    port = c.getsockname()[1]
    c.close()
    return port


def test_time_wait_sockets_of_connections_closing_at_once_are_all_tied(nettap_run, mode):
    """Two threads (the machine's two CPUs) each close 40 connections through
    TIME_WAIT at once, half of them captured: every captured one's TIME_WAIT
    socket is tied to its connection by its tuple (timewait_pending), whatever
    the CPU and whatever ran between its timer's start and its socket's CLOSE;
    none untied, none of the others followed. Their network namespace then
    removed: each purged."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)

    def scenario():
        lsns = [listener(PORT), listener(PORT + 1)]
        done = {}

        def worker(i):
            mine = []
            for n in range(40):
                port = PORT + (n % 2)
                c = socket.create_connection(("127.0.0.1", port), timeout=10)
                cport = close_client_first(lsns[n % 2], c)
                if port == PORT:
                    mine.append(cport)
            done[i] = mine
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for s in lsns:
            s.close()
        return done[0] + done[1]
    with own_netns() as mine:
        ports = in_netns(mine, scenario)
    wait_for(lambda: _tw_rows(run).get("purged") == 40, timeout=30, what="the namespace's TIME_WAIT sockets purged")
    wait_for(lambda: not live_conn_ids(run.app) - run.shared.seen, what="every socket destroyed")
    lines, _ = run.finish()
    tw = [l for l in lines if l["type"] == "timewait"]
    made = [l for l in tw if l["event"] == "made"]
    assert sorted(l["sport"] for l in made) == sorted(ports) and len(ports) == 40, made
    eofs = {l["sport"]: l["conn_id"] for l in lines if l["type"] == "eof" and l["dport"] == PORT}
    assert all(l["conn_id"] == eofs[l["sport"]] > 0 for l in made), made
    ended = sorted((l["sport"], l["event"]) for l in tw if l["event"] != "made")
    assert ended == [(p, "purged") for p in sorted(ports)], ended
    assert _tw_rows(run) == {"made": 40, "purged": 40}


def close_in(ns: str, port: int) -> None:
    """A connection from port to PORT, in ns, closed client first: its
    TIME_WAIT socket (60 s) left there."""
    def scenario():
        lsn = listener(PORT)
        close_client_first(lsn, connect_from(port))
        lsn.close()
    in_netns(ns, scenario)


def _req_rows(run) -> dict:
    from exporter.kernel import tcp_h
    obs = run.obs_counts()
    return {name: int(obs[tcp_h.OBS_REQUESTS + n]) for n, name in tcp_h.NAMES["REQ"].items()
            if obs[tcp_h.OBS_REQUESTS + n]}


def test_a_reload_that_detaches_the_timer_programs(nettap_run, mode):
    """capture.records without timewait and request detaches their programs.
    What they followed then, a TIME_WAIT socket (60 s) and a request whose
    handshake's ACK is dropped, is forgotten (exporter/kernel/followed.py):
    counted (forgotten) rather than left alive for ever or taken, should the
    programs come back, for a new socket at its address; their maps emptied,
    their counts zeroed. While detached, a captured connection closing
    through TIME_WAIT is neither followed nor counted as one not tied
    (nettap_ksyms' timer function cleared); asked for again, the next one is
    followed (and purged with its namespace, here and not in a later test's
    count), and the forgotten request's end (its client's reset) is no line.
    (One reload for both: each costs a guest seconds.)"""
    from conftest import EVERY_KIND
    from exporter.kernel import followed, maps
    rport = PORT + 2
    doc = {"captures": [{"port": PORT}, {"port": rport}]}
    run = nettap_run(doc)
    _skip_unattached(run)
    if not run.app.probes.separate["tcp_request"].attached:
        pytest.skip(f"tcp_request not attached: {run.app.probes.separate['tcp_request'].error}")
    fds, info = run.app.probes.map_fds, run.app.probes.map_info
    with own_netns() as mine:
        rule = ("table inet nettap_test {\n chain in {\n  type filter hook input priority 0; policy accept;\n"
                f"  tcp dport {rport} tcp flags & (syn | ack | rst) == ack drop\n }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", mine, "nft", "-f", "-"], input=rule.encode(), check=True)
        close_in(mine, CPORT + 6)
        lsn, held = in_netns(mine, lambda: (listener(rport), socket.create_connection(("127.0.0.1", rport), 10)))
        # the first connection's request too (PORT is captured): made and established
        wait_for(lambda: (_tw_rows(run).get("made"), _req_rows(run).get("made")) == (1, 2),
                 what="a TIME_WAIT socket and a request followed")
        known = (maps.count(fds["timewait_socks"], 8), maps.count(fds["request_socks"], 8))  # and an earlier test's
        assert min(known) >= 1, known
        run.apply({**doc, "capture": {"records": [k for k in EVERY_KIND if k not in ("timewait", "request")]}})
        assert not run.app.probes.separate["tcp_timewait"].attached
        assert (_tw_rows(run), _req_rows(run)) == ({"made": 1, "forgotten": known[0]},
                                                   {"made": 2, "established": 1, "forgotten": known[1]})
        assert [maps.count(fds[m], 8) for m in ("timewait_socks", "request_socks", "request_listeners")] == [0] * 3
        (off, _), = followed.var_offsets(run.app.probes._path, [(".bss.timers", "timewait_tracked")]).values()
        assert maps.lookup(fds[".bss.timers"], bytes(4), info[".bss.timers"][2])[off:off + 4] == bytes(4)
        size = info[".bss.requests"][2]                         # requests_tracked, request_slots_armed
        assert maps.lookup(fds[".bss.requests"], bytes(4), size) == bytes(size)
        close_in(mine, CPORT + 3)
        run.apply(doc)
        assert run.app.probes.separate["tcp_timewait"].attached
        close_in(mine, CPORT + 4)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        cport = held.getsockname()[1]
        held.close()                                            # its RST reaches the forgotten request
        lsn.close()
    wait_for(lambda: _tw_rows(run).get("purged"), timeout=30, what="the namespace's TIME_WAIT sockets purged")
    lines, tw = timewait_lines(run, CPORT + 4)
    assert [l["event"] for l in tw] == ["made", "purged"], tw
    for port, want in ((CPORT + 3, []), (CPORT + 6, ["made"])):
        got = [l["event"] for l in lines if l["type"] == "timewait" and l["sport"] == port]
        assert got == want, (port, got)
    assert [l["outcome"] for l in lines if l["type"] == "request" and l["dport"] == cport] == ["made"]
    assert _tw_rows(run) == {"made": 2, "forgotten": known[0], "purged": 1}
    assert _req_rows(run) == {"made": 3, "established": 2, "forgotten": known[1]}


def test_tcp_tw_reuse_takes_a_time_wait_socket_for_a_port_the_kernel_picks(nettap_run, mode, ns):
    """net.ipv4.tcp_tw_reuse 1 and one local port to pick from: a connect
    without bind, more than a second after the first connection left its
    TIME_WAIT socket on that port (tcp_twsk_unique's condition), is given
    the port by taking the TIME_WAIT socket over (__inet_hash_connect):
    reused, tied to the first connection."""
    run = nettap_run({"captures": [{"port": PORT}]})
    _skip_unattached(run)
    port = CPORT + 5
    sysctl(ns, "net.ipv4.tcp_tw_reuse", 1)
    sysctl(ns, "net.ipv4.ip_local_port_range", f"{port} {port}")

    def scenario():
        lsn = listener(PORT)
        c = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        assert c.getsockname()[1] == port
        close_client_first(lsn, c)
        time.sleep(2.1)                          # its timestamp's second past
        try:
            again = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        except OSError as e:
            return f"the kernel gave no port: {e}"
        assert again.getsockname()[1] == port
        s2, _ = lsn.accept()
        for sock in (again, s2):                  # gone by a reset: no TIME_WAIT socket of theirs
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        lsn.close()
        return ""
    refused = in_netns(ns, scenario)
    if refused:
        pytest.skip(refused)
    lines, tw = timewait_lines(run, port)
    first = [l for l in lines if l["type"] == "eof" and l["sport"] == port]
    assert [l["event"] for l in tw] == ["made", "reused"], tw
    assert tw[0]["conn_id"] == tw[1]["conn_id"] == first[0]["conn_id"] > 0
    assert 1900 <= tw[1]["age_ms"] <= 10000, tw
    assert _tw_rows(run) == {"made": 1, "reused": 1}
