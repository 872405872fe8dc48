#!/usr/bin/env python3
"""Kernel cost of nettap's send programs, in ns per run, from the kernel's
own BPF statistics, beside a baseline measured in the same run: empty
programs on the same attach points (what running any BPF program there
costs). One table per attach mechanism the kernel offers (fentry/fexit,
kprobe/kretprobe, syscall tracepoints) and per program variant it runs.

  filtered out   sends on a port nettap does not capture (the common case:
                 the seed saw 30,000 filtered runs per captured one)
  captured N B   sends of N bytes on a captured port (one chunk per 400 bytes)
  sampled out    64-byte sends on the captured port, its connection left out
                 by capture.sample_connections (1 in 2^24: every connection)

and of the lifecycle programs (BTF raw tracepoints: state changes, destruction,
resets, errors, segments received, timers fired) per variant, beside empty programs on the same tracepoints,
for connections (each: connect, one byte, close; and a refused connect) on a
port nettap does not capture and on one it does.

and of the DNS programs (capture.dns) per variant, by the mechanism the
kernel gives them (fentry/fexit or kprobe/kretprobe on inet_sendmsg,
inet6_sendmsg, inet_recvmsg, inet6_recvmsg; else syscall tracepoints on
sendto, write, sendmsg, sendmmsg, recvfrom, read, recvmsg and the receives'
exits), each beside an empty program on the same attach point, for UDP
datagrams on the loopback that are not DNS (sendto/recvfrom, and write/read
on a connected pair) while no target matches them, and for DNS queries to a
local responder on port 53 from a captured process.

and what a TLS call costs its process with nettap's uprobes (Go's
crypto/tls and OpenSSL's libssl, beside empty uprobes on the same points and
no uprobe at all, captured and not): tls_cost.py.

and, for the compat tracepoint programs, the same filtered-out and captured
cases as each kernel older than 6.1 runs them (the older paths forced: the
features such a kernel lacks are said missing to the loader).

Run as root:  .venv/bin/python bench/probe_cost.py [--sends 200000] [--sizes 64,4000]
                                                   [--variants fast,compat]
                                                   [--sections send,compat-paths,lifecycle,tls,dns]
                                                   [--tls-calls 8000] [--tls-rounds 15]
  the DNS programs alone:  .venv/bin/python bench/probe_cost.py --sections dns
  the TIME_WAIT and request programs alone:  .venv/bin/python bench/probe_cost.py --sections closing
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from exporter import config  # noqa: E402
from exporter.kernel import arch, features, libbpf, loader, mechanisms, tcp_h  # noqa: E402
from exporter.commands.daemon import Nettap  # noqa: E402
from exporter.kernel.bpfstats import StatsSwitch, own_program_stats  # noqa: E402
from procs import free_port  # noqa: E402
from traffic import Server  # noqa: E402
import tls_cost  # noqa: E402

EMPTY_PREFIX = {"tracepoint": "empty_tp", "fentry": "empty_fentry", "kprobe": "empty_kprobe"}


def sends(port: int, n: int, size: int) -> None:
    code = (f"import socket\ns=socket.socket(); s.connect(('127.0.0.1',{port}))\n"
            f"m=b'x'*{size}\nfor i in range({n}): s.sendall(m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def delta(after, before):
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def ns(d, name):
    runs, t = d[name]
    return t / runs if runs else float("nan")


def build_empty(tmp: str) -> str:
    """bench/empty.bpf.c built for this machine (bpf/vmlinux_min.h, which it
    includes, wants the target architecture, as bpf/Makefile gives it)."""
    obj_path = os.path.join(tmp, "empty.bpf.o")
    subprocess.run(["clang", "-g", "-O2", "-target", "bpf", f"-D__TARGET_ARCH_{arch.target()}", "-I", "/usr/include",
                    "-c", os.path.join(ROOT, "bench/empty.bpf.c"), "-o", obj_path], check=True)
    return obj_path


def empty_programs(obj_path: str, mechanism: str, nettap_names: dict):
    """Load and attach the empty pair of one mechanism; returns (obj, links, fds).
    nettap_names: role (enter, exit) -> the nettap program measured beside it:
    a tracepoint pair is attached to every tracepoint that program serves
    (write and sendto, say), so both average over the same calls."""
    obj = libbpf.call_ptr("bpf_object__open_file", obj_path.encode(), None)
    want = {f"{EMPTY_PREFIX[mechanism]}_{s}": s for s in ("enter", "exit")}
    for name, prog in loader.object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, name in want)
    libbpf.call("bpf_object__load", obj)
    links, fds = [], {}
    for name, role in want.items():
        p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
        if mechanism == "tracepoint":
            for cat, tp in loader.attached_tracepoints()[nettap_names[role].removesuffix("_compat")]:
                links.append(libbpf.call_ptr("bpf_program__attach_tracepoint", p, cat.encode(), tp.encode()))
        else:
            links.append(libbpf.call_ptr("bpf_program__attach", p))
        fds[role] = libbpf.call("bpf_program__fd", p)
    return obj, links, fds


def release(links, obj, app) -> None:
    """The empty programs' links and object, then nettap."""
    for link in links:
        libbpf.lib().bpf_link__destroy(link)
    libbpf.lib().bpf_object__close(obj)
    app.close()


# The compat programs' paths by kernel: the features (features.py) a kernel
# older than 6.1 lacks, each making the compat programs take an older path
# (docs/kernels.md). Measured here by telling the loader they are missing.
COMPAT_PATHS = (("Linux 6.1 (all of them)", ()),
                ("5.17-6.0: call state removed at return", ("bpf_mem_alloc",)),
                ("5.11-5.16: and an open-coded chunk loop", ("bpf_mem_alloc", "bpf_loop")),
                ("5.8-5.10: and the fd table by helper", ("bpf_mem_alloc", "bpf_loop", "bpf_get_current_task_btf")))


def measure(mechanism: str, variant: str, empty_obj: str, n: int, sizes: list, missing=()) -> dict:
    """case -> {program role: ns per run} for one mechanism and variant, as
    on a kernel without the features named in missing."""
    captured, other = Server(), Server()
    cfg = config.parse({"captures": [{"port": captured.port}], "output": {"type": "none"}})
    probes = None
    if missing:
        kp = mechanisms.plan(mechanism, variant)
        for f in kp.features:
            f.present = f.present and f.name not in missing
        probes = loader.Probes(cfg.ring_bytes, kernel_plan=kp)
    app = Nettap(cfg, mechanism=mechanism, variant=variant, probes=probes)
    if app.probes.states["tcp_sendmsg"].mechanism != mechanism:
        app.close()
        raise RuntimeError(f"tcp_sendmsg not attached by {mechanism}")
    exit_name, enter_name = loader.programs_for("tcp_sendmsg", mechanism, variant)[:2]
    obj, links, efds = empty_programs(empty_obj, mechanism, {"enter": enter_name, "exit": exit_name})
    fds = {"nettap enter": app.probes.prog_fds[enter_name], "nettap exit": app.probes.prog_fds[exit_name],
           "empty enter": efds["enter"], "empty exit": efds["exit"]}
    rows = {}
    try:
        cases = [("filtered out", other.port, 64)] + [(f"captured {s} B", captured.port, s) for s in sizes]
        cases.append(("sampled out", captured.port, 64))
        for case, port, size in cases:
            if case == "sampled out":   # the captured port, 1 in 2^24 connections: this one left out
                app.apply(config.parse({"captures": [{"port": captured.port}], "output": {"type": "none"},
                                        "capture": {"sample_connections": 1 << 24}}))
            before = own_program_stats(fds)
            sends(port, n, size)
            d = delta(own_program_stats(fds), before)
            rows[case] = {k: ns(d, k) for k in fds}
    finally:
        release(links, obj, app)
    return rows


# nettap's lifecycle program -> the empty program on its tracepoint (bench/empty.bpf.c)
LIFECYCLE_EMPTY = {"tcp_state": "empty_lc_state", "tcp_destroy": "empty_lc_destroy",
                   "tcp_rst_sent": "empty_lc_rst_sent", "tcp_rst_recv": "empty_lc_rst_recv",
                   "tcp_sk_error": "empty_lc_sk_error", "tcp_segment": "empty_lc_segment"}
# tcp_timer and tcp_timer_exit, and the TIME_WAIT and request programs, run
# for every timer of the node: measured apart, with timers firing
# (measure_timers; their record kinds asked for, so that they are attached)
# The TIME_WAIT and request programs: on the timer tracepoints, and tcp_request_state on state changes.
CLOSING_EMPTY = {"tcp_timewait": "empty_lc_timewait", "tcp_timewait_end": "empty_lc_timewait_end",
                 "tcp_timewait_expire": "empty_lc_timewait_expire", "tcp_request": "empty_lc_request",
                 "tcp_request_end": "empty_lc_request_end", "tcp_request_exit": "empty_lc_request_exit",
                 "tcp_request_state": "empty_lc_request_state"}
TIMER_EMPTY = {"tcp_timer": "empty_lc_timer", "tcp_timer_exit": "empty_lc_timer_exit", **CLOSING_EMPTY}
TIMER_RECORDS = ["timer", "probe", "timewait", "request"]
# tcp_retransmit and tcp_synack_retransmit run only when a segment is sent
# again: measured apart, on a lossy loopback (measure_lossy).
LOSSY_EMPTY = {"tcp_retransmit": "empty_lc_retransmit", "tcp_synack_retransmit": "empty_lc_synack"}


HELD_OPEN = 150          # connections (300 captured sockets) open during the third lifecycle case


def connections(port: int, refused_port: int, n: int) -> None:
    """n connections to port (connect, one byte, close) and n refused connects."""
    code = (f"import socket\nfor i in range({n}):\n"
            f"    s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'x'); s.close()\n"
            f"    c = socket.socket()\n"
            f"    try: c.connect(('127.0.0.1', {refused_port}))\n"
            f"    except ConnectionRefusedError: pass\n"
            f"    c.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def measure_lifecycle(variant: str, empty_obj: str, n: int) -> dict:
    """case -> {program: (nettap ns per run, empty ns per run)} for one variant."""
    captured, other = Server(), Server()
    closed = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    refused = [s.getsockname()[1] for s in closed]
    for s in closed:
        s.close()                                   # nothing listens there now
    # the captured port records its segments (tcp_segment's whole path)
    app = Nettap(config.parse({"captures": [{"port": captured.port, "segments": True}, {"port": refused[1]}],
                               "output": {"type": "none"}}), variant=variant)
    # the loaded programs (the variant's names; tcp_sk_error where the kernel has its tracepoint)
    names = {short: full for short in LIFECYCLE_EMPTY for full in (short, f"{short}_compat")
             if full in app.probes.prog_fds}
    obj = libbpf.call_ptr("bpf_object__open_file", empty_obj.encode(), None)
    want = {LIFECYCLE_EMPTY[short] for short in names}
    for name, prog in loader.object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, name in want)
    libbpf.call("bpf_object__load", obj)
    links, fds = [], {}
    try:
        for short, full in names.items():
            p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, LIFECYCLE_EMPTY[short].encode())
            links.append(libbpf.call_ptr("bpf_program__attach", p))
            fds[f"empty {short}"] = libbpf.call("bpf_program__fd", p)
            fds[f"nettap {short}"] = app.probes.prog_fds[full]
        rows = {}
        # the third case: while HELD_OPEN captured connections stay open, every
        # group of the table's front door has an entry (bpf/conn.bpf.h)
        for case, port, refused_port, held in (("not captured", other.port, refused[0], 0),
                                               ("captured", captured.port, refused[1], 0),
                                               (f"not captured, {2 * HELD_OPEN} captured open", other.port,
                                                refused[0], HELD_OPEN)):
            hold = [socket.create_connection(("127.0.0.1", captured.port)) for _ in range(held)]
            try:
                before = own_program_stats(fds)
                connections(port, refused_port, n)
                d = delta(own_program_stats(fds), before)
            finally:
                for s in hold:
                    s.close()
            rows[case] = {short: (ns(d, f"nettap {short}"), ns(d, f"empty {short}"), d[f"nettap {short}"][0])
                          for short in names}
    finally:
        release(links, obj, app)
    return rows


LOSSY_SERVER = r"""
import socket, sys, threading
def read(c):
    with c:
        while c.recv(65536):
            pass
def serve(port):
    s = socket.create_server(("127.0.0.1", port), backlog=256)
    while True:
        threading.Thread(target=read, args=(s.accept()[0],), daemon=True).start()
for p in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("listening", flush=True)
sys.stdin.read()
"""
LOSSY_CLIENT = r"""
import socket, sys, threading
port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def run(k):
    for _ in range(k):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"x" * size)
        s.close()
ts = [threading.Thread(target=run, args=(n // 32,)) for _ in range(32)]
for t in ts: t.start()
for t in ts: t.join()
"""


def _attach_empty(app, empty_obj: str, pairs: dict):
    """The empty programs of pairs (nettap program -> empty program) loaded
    and attached beside the loaded nettap ones; returns (obj, links, fds)."""
    # the loaded programs: the variant's names (tcp_request_compat), others shared by both
    names = {short: full for short in pairs for full in (short, f"{short}_compat") if full in app.probes.prog_fds}
    obj = libbpf.call_ptr("bpf_object__open_file", empty_obj.encode(), None)
    for pname, prog in loader.object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, pname in {pairs[s] for s in names})
    libbpf.call("bpf_object__load", obj)
    links, fds = [], {}
    for short, full in names.items():
        p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, pairs[short].encode())
        links.append(libbpf.call_ptr("bpf_program__attach", p))
        fds[f"empty {short}"] = libbpf.call("bpf_program__fd", p)
        fds[f"nettap {short}"] = app.probes.prog_fds[full]
    return obj, links, fds


def _rows(d: dict, fds: dict) -> dict:
    shorts = [k.removeprefix("nettap ") for k in fds if k.startswith("nettap ")]
    return {short: (ns(d, f"nettap {short}"), ns(d, f"empty {short}"), d[f"nettap {short}"][0]) for short in shorts}


def measure_timers(variant: str, empty_obj: str, n: int, seconds: float = 8.0) -> dict:
    """case -> {program: (nettap ns, empty ns, runs)} of the timer programs,
    which run for every timer of the node: n sockets with a keepalive every
    second (each fires its timer once a second and sends a probe the peer
    answers) to a port nettap does not capture, then to one it does."""
    captured, other = Server(), Server()
    app = Nettap(config.parse({"captures": [{"port": captured.port}], "output": {"type": "none"},
                               "capture": {"records": TIMER_RECORDS}}), variant=variant)
    obj, links, fds = _attach_empty(app, empty_obj, TIMER_EMPTY)
    rows = {}
    try:
        for case, port in (("keepalives, not captured", other.port), ("keepalives, captured", captured.port)):
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
            try:
                before = own_program_stats(fds)
                for s in socks:
                    for opt in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL):
                        s.setsockopt(socket.IPPROTO_TCP, opt, 1)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                time.sleep(seconds)
                rows[case] = _rows(delta(own_program_stats(fds), before), fds)
            finally:
                for s in socks:
                    s.close()
    finally:
        release(links, obj, app)
    return rows


def closings(port: int, n: int) -> None:
    """n connections to port that the client closes first (connect, one
    byte, close): each a request socket made and established, and a TIME_WAIT
    socket left on the client's side for 60 s."""
    code = (f"import socket\nfor i in range({n}):\n"
            f"    s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'x'); s.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# Attached before nettap on each tracepoint of the closing and expiring
# cases (bench/empty.bpf.c): the first program on a tracepoint pays ~21 ns
# a run more than those after it, whichever it is (bench/steps.py's lead);
# with these first, neither nettap's program nor its empty one is.
LEADS = ("empty_lead_start", "empty_lead_cancel", "empty_lead_expire_entry", "empty_lead_expire_exit",
         "empty_lead_state")


def attach_leads(empty_obj: str):
    """The lead programs loaded and attached; returns (obj, links)."""
    obj = libbpf.call_ptr("bpf_object__open_file", empty_obj.encode(), None)
    for pname, prog in loader.object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, pname in LEADS)
    libbpf.call("bpf_object__load", obj)
    links = [libbpf.call_ptr("bpf_program__attach",
                             libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode()))
             for name in LEADS]
    return obj, links


def release_leads(lead) -> None:
    obj, links = lead
    for link in links:
        libbpf.lib().bpf_link__destroy(link)
    libbpf.lib().bpf_object__close(obj)


def median_rows(rounds: list) -> dict:
    """{program: (nettap ns, empty ns, runs)}, each the median of the rounds'
    (a run the host stopped the vCPU in, ~1 ms, lifts one round's mean)."""
    return {short: tuple(statistics.median(r[short][i] for r in rounds) for i in range(3)) for short in rounds[0]}


def closing_rounds(variant: str, empty_obj: str, captures: list, cases, workload, rounds: int) -> dict:
    """case -> {program: (nettap ns, empty ns, runs)}: nettap (captures; its
    TIME_WAIT and request records asked for, so that those programs are
    attached) after the leads, the empty programs after it; each case's
    workload(*args) run rounds times, the median of them."""
    lead = attach_leads(empty_obj)
    try:
        app = Nettap(config.parse({"captures": captures, "output": {"type": "none"},
                                   "capture": {"records": ["timewait", "request"]}}), variant=variant)
        obj, links, fds = _attach_empty(app, empty_obj, CLOSING_EMPTY)
        rows = {}
        try:
            for case, args in cases:
                each = []
                for _ in range(rounds):
                    before = own_program_stats(fds)
                    workload(*args)
                    each.append(_rows(delta(own_program_stats(fds), before), fds))
                rows[case] = median_rows(each)
        finally:
            release(links, obj, app)
    finally:
        release_leads(lead)
    return rows


def measure_closing(variant: str, empty_obj: str, n: int, rounds: int = 3) -> dict:
    """The TIME_WAIT and request programs (closing_rounds) for connections
    closed client first: to a port nettap does not capture (their request
    sockets, TIME_WAIT sockets and state changes are the programs' own
    kinds, each told no: the goal's case), then to one it does (the rounds
    of the first case first: none of its sockets followed)."""
    captured, other = Server(), Server()

    def workload(port: int) -> None:
        closings(port, n)
        time.sleep(0.5)                         # the servers' closes
    return closing_rounds(variant, empty_obj, [{"port": captured.port}],
                          (("closed first, not captured", (other.port,)), ("closed first, captured", (captured.port,))),
                          workload, rounds)


# The expiring case's workload, in a network namespace (tcp_fin_timeout 1,
# tcp_synack_retries 1, the handshakes' last ACKs to the request ports
# dropped): listeners on a TIME_WAIT port and a request port; n connections
# to the first closed at once (the client's socket, its FIN acknowledged but
# the peer's never sent, a TIME_WAIT socket in FIN_WAIT2 that expires after
# tcp_fin_timeout: 1 s), n to the second held open (each a request socket
# whose SYN-ACK is sent once again at 1 s and that times out at 3 s); "ready",
# then, on a line, the held ones reset (SO_LINGER 0: the RST passes).
EXPIRING_CLIENT = r"""
import socket, struct, sys
tw_port, req_port, n = (int(a) for a in sys.argv[1:])
lsn = [socket.create_server(("127.0.0.1", p), backlog=4096) for p in (tw_port, req_port)]
for _ in range(n):
    socket.create_connection(("127.0.0.1", tw_port)).close()
held = [socket.create_connection(("127.0.0.1", req_port)) for _ in range(n)]
print("ready", flush=True)
sys.stdin.readline()
for s in held:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
"""


def _expiring_ns(name: str, req_ports) -> None:
    """The expiring case's network namespace: loopback up, the sysctls, the rule."""
    from pyroute2 import NetNS, netns
    netns.create(name)
    with NetNS(name) as handle:
        handle.link("set", index=handle.link_lookup(ifname="lo")[0], state="up")
    for k, v in (("net.ipv4.tcp_fin_timeout", 1), ("net.ipv4.tcp_synack_retries", 1)):
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw", f"{k}={v}"], check=True)
    ports = ", ".join(str(p) for p in req_ports)
    rules = (f"table inet nettap_bench {{ chain in {{ type filter hook input priority 0; policy accept;\n"
             f" tcp dport {{ {ports} }} tcp flags & (syn | ack | rst) == ack drop\n }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=rules.encode(), check=True)


def _expire(name: str, tw_port: int, req_port: int, n: int) -> None:
    """One round of EXPIRING_CLIENT in the namespace: until its timers have fired."""
    client = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", EXPIRING_CLIENT,
                               str(tw_port), str(req_port), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        time.sleep(4.5)                         # 1 s of TIME_WAIT, 3 s to a request's timeout
        client.communicate("go\n", timeout=60)
    finally:
        client.kill()
        client.wait()


def measure_expiring(variant: str, empty_obj: str, n: int, rounds: int = 3) -> dict:
    """The TIME_WAIT and request programs (closing_rounds) as their own kinds
    of timer expire (EXPIRING_CLIENT: n TIME_WAIT sockets expiring, n
    requests timing out), on ports nettap does not capture, then on ports it
    does."""
    from pyroute2 import netns
    name = f"nettap-bench-exp-{os.getpid()}"
    try:
        _expiring_ns(name, [9311, 9321])
        return closing_rounds(variant, empty_obj, [{"port": 9320}, {"port": 9321}],
                              (("expiring, not captured", (9310, 9311)), ("expiring, captured", (9320, 9321))),
                              lambda tw_port, req_port: _expire(name, tw_port, req_port, n), rounds)
    finally:
        netns.remove(name)


def measure_lossy(variant: str, empty_obj: str, n: int) -> dict:
    """case -> {program: (nettap ns, empty ns, runs)} of the programs that run
    when a segment is sent again: n connections (20 KB each) in a network
    namespace whose loopback drops a fifth of the packets to and from two
    ports (nftables), one captured and one not."""
    from pyroute2 import NetNS, netns
    name = f"nettap-bench-{os.getpid()}"
    captured, other = 9300, 9301
    netns.create(name)
    srv = app = obj = None
    links = []
    try:
        with NetNS(name) as handle:
            handle.link("set", index=handle.link_lookup(ifname="lo")[0], state="up")
        rules = (f"table inet nettap_bench {{ chain in {{ type filter hook input priority 0; policy accept;\n"
                 f" tcp dport {{ {captured}, {other} }} numgen random mod 5 == 0 drop\n"
                 f" tcp sport {{ {captured}, {other} }} numgen random mod 5 == 0 drop\n }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=rules.encode(), check=True)
        srv = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", LOSSY_SERVER, str(captured),
                                str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "listening"
        app = Nettap(config.parse({"captures": [{"port": captured}], "output": {"type": "none"}}), variant=variant)
        obj, links, fds = _attach_empty(app, empty_obj, LOSSY_EMPTY)
        rows = {}
        for case, port in (("lossy, not captured", other), ("lossy, captured", captured)):
            before = own_program_stats(fds)
            subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", LOSSY_CLIENT, str(port), str(n),
                            "20000"], check=True)
            rows[case] = _rows(delta(own_program_stats(fds), before), fds)
        return rows
    finally:
        if srv:
            srv.kill()
            srv.wait()
        if obj:
            release(links, obj, app)
        elif app:
            app.close()
        netns.remove(name)


# The DNS programs' workload, in a network namespace of its own (port 53 of
# its loopback is free): commands on stdin, "udp N" (N sendto+recvfrom of
# 64 B to a port other than 53, then N write+read of 64 B on a connected
# pair) and "dns N" (N queries by sendto+recvfrom to port 53, then N by
# write+read on a socket connected to it); answers "done" to each.
DNS_WORKLOAD = r"""
import os, socket, struct, sys
lo = "127.0.0.1"
def udp(bind=True):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if bind:
        s.bind((lo, 0))
    return s
rx, tx, a, b, q, c = udp(), udp(False), udp(), udp(), udp(False), udp(False)
a.connect(b.getsockname())
b.connect(a.getsockname())
c.connect((lo, 53))
for s in (q, c):    # blocking (read() takes no timeout), but not for ever
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 5, 0))
m = b"x" * 64
def query(i):
    return (struct.pack("!HHHHHH", i & 0xffff, 0x0100, 1, 0, 0, 0)
            + b"\x05bench\x07example\x00\x00\x01\x00\x01")
print(os.getpid(), flush=True)
for line in sys.stdin:
    what, n = line.split()
    n = int(n)
    if what == "udp":
        dst = rx.getsockname()
        for _ in range(n):
            tx.sendto(m, dst)
            rx.recvfrom(2048)
        wa, rb = a.fileno(), b.fileno()
        for _ in range(n):
            os.write(wa, m)
            os.read(rb, 2048)
    else:
        for i in range(n):
            q.sendto(query(i), (lo, 53))
            q.recvfrom(512)
        fd = c.fileno()
        for i in range(n):
            os.write(fd, query(i))
            os.read(fd, 512)
    print("done", flush=True)
"""
# Answers every query on 127.0.0.1:53 with NXDOMAIN (the query, its flags
# made a response's).
DNS_RESPONDER = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 53))
print("ready", flush=True)
while True:
    w, peer = s.recvfrom(512)
    s.sendto(w[:2] + b"\x81\x83" + w[4:], peer)
"""
# The cases no target matches: the goal (<= empty + 20 ns per run) is theirs.
DNS_FILTERED = ("filtered out, pid target", "filtered out, port target")


def _empty_beside(empty_obj: str, mechanism: str, progs: dict):
    """An empty program beside each of progs (label -> (role, where): the
    tracepoints, or the kernel function, of the nettap program it is
    measured beside): a load of its own of the empty object each, so each
    counts only the calls of its own attach points. Returns (objects, links, fds)."""
    objs, links, fds = [], [], {}
    try:
        for label, (role, where) in progs.items():
            obj = libbpf.call_ptr("bpf_object__open_file", empty_obj.encode(), None)
            objs.append(obj)
            name = f"{EMPTY_PREFIX[mechanism]}_{role}"
            for pname, prog in loader.object_programs(obj):
                libbpf.call("bpf_program__set_autoload", prog, pname == name)
            p = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
            if mechanism == "fentry":         # empty.bpf.c's section names tcp_sendmsg
                libbpf.call("bpf_program__set_attach_target", p, 0, where.encode())
            libbpf.call("bpf_object__load", obj)
            if mechanism == "tracepoint":
                for cat, tp in where:
                    links.append(libbpf.call_ptr("bpf_program__attach_tracepoint", p, cat.encode(), tp.encode()))
            elif mechanism == "kprobe":
                links.append(libbpf.call_ptr("bpf_program__attach_kprobe", p, role == "exit", where.encode()))
            else:
                links.append(libbpf.call_ptr("bpf_program__attach", p))
            fds[label] = libbpf.call("bpf_program__fd", p)
    except BaseException:
        _release_empty(objs, links)
        raise
    return objs, links, fds


def _release_empty(objs, links) -> None:
    loader.destroy_links(links)
    for obj in objs:
        libbpf.lib().bpf_object__close(obj)


def _dns_config(target: dict, ring: int):
    return config.parse({"captures": [target], "capture": {"dns": True}, "output": {"type": "none"},
                         "rings": {"dns": ring}})


def _dns_ring(queries: int) -> int:
    """A dns ring that holds every record of the captured case (4 per
    --dns-queries: a query by sendto and one by write, each with its answer;
    tcp_h.STRIDES["dns"] bytes each in the ring): the daemon drains it every
    0.2 s at the latest (sized for a node's hundreds of messages a second),
    and a dropped record costs less than a published one."""
    need = 4 * queries * tcp_h.STRIDES["dns"]
    return max(128 << 10, 1 << (need - 1).bit_length())


def measure_dns(mech: str, variant: str, empty_obj: str, n: int, queries: int) -> tuple:
    """(mech, case -> {program: (nettap ns, empty ns, runs)}) of the DNS
    programs of one mechanism and variant, each beside an empty program on
    its attach point, and per
    case ("queries", count, nettap ns, empty ns, ring drops) totals; the
    workload (DNS_WORKLOAD) in a network namespace of its own:

      filtered out, pid target   n UDP sendto+recvfrom and n write+read, not
                                 DNS; the target: another process's pid
      filtered out, port target  the same; the target: a port other than 53
      captured pid, not DNS      the same; the target: the workload's pid
      captured pid, DNS queries  queries by sendto+recvfrom and as many by
                                 write+read, to a responder on port 53 (a
                                 process not captured); the target: the
                                 workload's pid"""
    from exporter.kernel import dns
    from pyroute2 import NetNS, netns
    name = f"nettap-bench-dns-{os.getpid()}"
    netns.create(name)
    procs, app, objs, links = [], None, [], []
    try:
        with NetNS(name) as handle:
            handle.link("set", index=handle.link_lookup(ifname="lo")[0], state="up")
        other = subprocess.Popen(["sleep", "infinity"])
        procs.append(other)
        responder = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", DNS_RESPONDER],
                                     stdout=subprocess.PIPE, text=True)
        procs.append(responder)
        assert responder.stdout.readline().strip() == "ready"
        work = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", DNS_WORKLOAD],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(work)
        work_pid = int(work.stdout.readline())

        def run(command: str) -> None:
            work.stdin.write(command + "\n")
            work.stdin.flush()
            if work.stdout.readline().strip() != "done":
                raise RuntimeError(f"DNS workload failed at {command!r} (exit {work.poll()})")

        ring = _dns_ring(queries)
        app = Nettap(_dns_config({"pid": other.pid}, ring), mechanism=mech, variant=variant)
        st = app.probes.dns.state
        if (st.mechanism, st.attached) != (mech, True):
            raise RuntimeError(f"DNS programs not attached by {mech}: {st.error}")
        progs = {full.removesuffix("_compat"): full for full in dns.programs(variant, mech)}
        if mech == "tracepoint":
            where = {short: ("exit" if "_exit" in short else "enter", loader.attached_tracepoints()[short])
                     for short in progs}
        else:       # dns_<function>_<fentry|fexit|kprobe|kretprobe>
            where = {short: ("exit" if short.endswith(("_fexit", "_kretprobe")) else "enter",
                             short.removeprefix("dns_").rsplit("_", 1)[0]) for short in progs}
        objs, links, efds = _empty_beside(empty_obj, mech, {f"empty {s}": w for s, w in where.items()})
        fds = {**efds, **{f"nettap {short}": app.probes.prog_fds[full] for short, full in progs.items()}}
        rows = {}
        for case, target, command, nq in (
                ("filtered out, pid target", {"pid": other.pid}, f"udp {n}", 0),
                ("filtered out, port target", {"port": free_port()}, f"udp {n}", 0),
                ("captured pid, not DNS", {"pid": work_pid}, f"udp {n}", 0),
                ("captured pid, DNS queries", {"pid": work_pid}, f"dns {queries}", 2 * queries)):
            app.apply(_dns_config(target, ring))
            drops = app.drops()["dns"]
            before = own_program_stats(fds)
            run(command)
            d = delta(own_program_stats(fds), before)
            r = _rows(d, fds)
            if nq:
                tot = {side: sum(d[f"{side} {short}"][1] for short in progs) for side in ("nettap", "empty")}
                r["queries"] = (nq, tot["nettap"] / nq, tot["empty"] / nq, app.drops()["dns"] - drops)
            rows[case] = r
        return mech, rows
    finally:
        _release_empty(objs, links)
        if app:
            app.close()
        for p in procs:
            p.kill()
            p.wait()
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()
        netns.remove(name)


def print_dns(n: int, queries: int, results: list) -> None:
    print(f"\nDNS programs (capture.dns; ns per run, beside an empty program on the same attach point, "
          f"by the mechanism the kernel gives them; per not-DNS case {n:,} UDP sendto+recvfrom and {n:,} "
          f"write+read of 64 B on the loopback, to a port other than 53; DNS case: {queries:,} queries by "
          f"sendto+recvfrom and {queries:,} by write+read to a responder on port 53)")
    verdicts = []
    for variant, (mech, rows) in results:
        w = max(14, *(len(short) for progs in rows.values() for short in progs))
        print(f"\n{variant + ' variant, ' + mech:27s} {'program':>{w}s} {'runs':>9s} {'empty':>7s} {'nettap':>7s}"
              f" {'diff':>6s} {'ratio':>6s}")
        for case, progs in rows.items():
            for short, row in progs.items():
                if short == "queries":
                    continue
                nt, em, runs = row
                if not runs:
                    continue
                mark = ""
                if case in DNS_FILTERED:
                    ok = nt - em <= 20
                    mark = "  ok" if ok else "  OVER"
                    verdicts.append(ok)
                print(f"{case:27s} {short:>{w}s} {runs:9d} {em:7.0f} {nt:7.0f} {nt - em:+6.0f}"
                      f" {nt / em:6.2f}{mark}")
            if "queries" in progs:
                nq, nt, em, drops = progs["queries"]
                print(f"{case:27s} {'per query':>{w}s} {nq:9d} {em:7.0f} {nt:7.0f} {nt - em:+6.0f}"
                      f" {nt / em:6.2f}  (all DNS programs' time / queries; dns ring drops: {drops})")
    print("\n(runs: every call of the node on those attach points while the case ran, the workload's and others'; "
          "per query: the run time of all DNS programs during the case, the responder's calls and the node's "
          "included, over the queries sent; goal: filtered out <= empty + 20 ns per run"
          + (f": {'met' if all(verdicts) else 'NOT met'} by every program that ran)" if verdicts else ")"))


def print_lifecycle(n: int, results: list, expiring: int) -> None:
    print(f"\nlifecycle programs (ns per run; {n:,} connections and {n:,} refused connects per case; the "
          "lossy cases: connections of 20 KB each on a loopback that drops a fifth of the packets; closed first: "
          f"{n:,} connections; expiring: {expiring:,} TIME_WAIT and {expiring:,} request sockets; those two the "
          "median of 3 rounds)")
    for variant, rows in results:
        print(f"\n{variant + ' variant':36s} {'program':>21s} {'runs':>8s} {'empty':>7s} {'nettap':>7s} {'ratio':>6s}")
        for case, progs in rows.items():
            for short, (nt, em, runs) in progs.items():
                if runs:                        # (a program the case never ran: tcp_request_state beside keepalives)
                    print(f"{case:36s} {short:>21s} {runs:8d} {em:7.0f} {nt:7.0f} {nt / em:6.2f}")
    print("\n(goal: a socket not captured costs <= 2x the empty program on the same tracepoint)")


def print_sends(results) -> None:
    """The send cases' table: per mechanism and variant, the empty program's
    and nettap's ns per run, and nettap's cost over the empty one."""
    for mech, variant, rows in results:
        title = f"{mech}, {variant} variant"
        if len(title) > 24:                     # a compat path: its own line
            print(f"\n{title}")
            title = ""
        print(f"{chr(10) if title else ''}{title:24s} {'empty program':>15s} {'nettap tcp_sendmsg':>19s}"
              f" {'nettap':>10s} {'over empty':>9s}")
        print(f"{'':24s} {'enter':>7s} {'exit':>7s} {'enter':>9s} {'exit':>9s} {'enter+exit':>10s}"
              f" {'per run':>9s}")
        for case, r in rows.items():
            e_in, e_out, n_in, n_out = (r["empty enter"], r["empty exit"], r["nettap enter"], r["nettap exit"])
            over = (n_in - e_in + n_out - e_out) / 2
            print(f"{case:24s} {e_in:7.0f} {e_out:7.0f} {n_in:9.0f} {n_out:9.0f} {n_in + n_out:10.0f} {over:+9.0f}")


def run_lifecycle(a, sections: set, empty_obj: str, lifecycle: list, skipped: list) -> None:
    """The lifecycle sections (lifecycle: state changes, timers, lossy; closing:
    the TIME_WAIT and request programs) per variant, into lifecycle; what
    could not run, into skipped."""
    for variant in (a.variants.split(",") if "lifecycle" in sections else ()):
        try:
            lifecycle.append((variant, measure_lifecycle(variant, empty_obj, a.connections)))
        except (features.Unsupported, OSError) as e:
            skipped.append(f"lifecycle, {variant}: {e}")
        try:
            lifecycle.append((variant, measure_timers(variant, empty_obj, a.keepalive_sockets)))
        except (features.Unsupported, OSError) as e:
            skipped.append(f"timers, {variant}: {e}")
        try:
            lifecycle.append((variant, measure_lossy(variant, empty_obj, a.lossy_connections)))
        except (features.Unsupported, OSError, subprocess.CalledProcessError) as e:
            skipped.append(f"lossy lifecycle, {variant}: {e}")
    for variant in (a.variants.split(",") if "closing" in sections else ()):
        try:
            lifecycle.append((variant, measure_closing(variant, empty_obj, a.connections)))
        except (features.Unsupported, OSError, subprocess.CalledProcessError) as e:
            skipped.append(f"closing, {variant}: {e}")
        try:
            lifecycle.append((variant, measure_expiring(variant, empty_obj, a.expiring)))
        except (features.Unsupported, OSError, subprocess.CalledProcessError) as e:
            skipped.append(f"expiring, {variant}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sends", type=int, default=200000)
    ap.add_argument("--sizes", default="64,4000", help="payload sizes of the captured cases, bytes")
    ap.add_argument("--variants", default="fast,compat", help="program variants to measure, where the kernel runs them")
    ap.add_argument("--connections", type=int, default=2000, help="connections per lifecycle case")
    ap.add_argument("--tls-calls", type=int, default=8000, help="write calls of 64 B per TLS client run")
    ap.add_argument("--tls-rounds", type=int, default=15, help="rounds of the TLS cases (interleaved)")
    ap.add_argument("--keepalive-sockets", type=int, default=400,
                    help="sockets with a keepalive a second per timer case (tcp_timer, tcp_timer_exit)")
    ap.add_argument("--expiring", type=int, default=1000,
                    help="TIME_WAIT sockets and request sockets per expiring case (the closing section)")
    ap.add_argument("--lossy-connections", type=int, default=320,
                    help="connections per case on the lossy loopback (tcp_retransmit, tcp_synack_retransmit)")
    ap.add_argument("--dns-calls", type=int, default=200000,
                    help="per not-DNS case: UDP sendto+recvfrom pairs, and as many write+read pairs (DNS programs)")
    ap.add_argument("--dns-queries", type=int, default=5000,
                    help="DNS queries by sendto+recvfrom, and as many by write+read, in the captured DNS case")
    ap.add_argument("--sections", default="send,compat-paths,lifecycle,closing,tls,dns",
                    help="what to measure: send (tcp_sendmsg per mechanism), compat-paths (the compat "
                         "tracepoint programs as each older kernel runs them), lifecycle, closing (the TIME_WAIT "
                         "and request programs), tls, dns")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    unknown = sections - {"send", "compat-paths", "lifecycle", "closing", "tls", "dns"}
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(sorted(unknown))} "
                         "(send, compat-paths, lifecycle, closing, tls, dns)")
    if os.geteuid() != 0:
        raise SystemExit("run as root: nettap loads BPF programs")
    sizes = [int(s) for s in a.sizes.split(",") if s]
    mechanisms.ensure_tracefs()
    switch = StatsSwitch()
    switch.set(True)
    empty_obj = build_empty(tempfile.mkdtemp(prefix="nettap-bench-"))
    results, skipped, lifecycle, tls_results, dns_results = [], [], [], [], []
    try:
        for mech in (mechanisms.MECHANISMS if "send" in sections else ()):
            st = mechanisms.plan(forced=mech).states["tcp_sendmsg"]
            if st.mechanism != mech:
                skipped.append(f"{mech}: not offered ({st.reasons[mech]})")
                continue
            for variant in a.variants.split(","):
                try:
                    results.append((mech, variant, measure(mech, variant, empty_obj, a.sends, sizes)))
                except (features.Unsupported, OSError, RuntimeError) as e:
                    skipped.append(f"{mech}, {variant}: {e}")
        for label, missing in (COMPAT_PATHS if "compat-paths" in sections else ()):
            try:
                results.append(("tracepoint", f"compat, {label}",
                                measure("tracepoint", "compat", empty_obj, a.sends, sizes[:1], missing)))
            except (features.Unsupported, OSError, RuntimeError) as e:
                skipped.append(f"compat, {label}: {e}")
        run_lifecycle(a, sections, empty_obj, lifecycle, skipped)
        tls_here, why = tls_cost.available() if "tls" in sections else (False, "")
        if why:
            skipped.append(f"tls: {why}")
        for variant in (a.variants.split(",") if tls_here else ()):
            try:
                tls_results.append((variant, tls_cost.measure_tls(variant, empty_obj, a.tls_calls, a.tls_rounds)))
            except (features.Unsupported, OSError, RuntimeError) as e:
                skipped.append(f"tls, {variant}: {e}")
        for mech in (mechanisms.MECHANISMS if "dns" in sections else ()):
            st = mechanisms.plan(forced=mech).dns
            if st.mechanism != mech:
                skipped.append(f"dns, {mech}: not offered ({st.reasons[mech]})")
                continue
            for variant in a.variants.split(","):
                try:
                    dns_results.append((variant, measure_dns(mech, variant, empty_obj, a.dns_calls, a.dns_queries)))
                except (features.Unsupported, OSError, RuntimeError, subprocess.CalledProcessError) as e:
                    skipped.append(f"dns, {mech}, {variant}: {e}")
    finally:
        switch.close()
    print("\nnettap probe cost (ns per run, kernel BPF statistics; "
          + (f"{a.sends:,} sends per case, " if "send" in sections else "")
          + f"kernel {os.uname().release}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')})")
    print_sends(results)
    if sections & {"lifecycle", "closing"}:
        print_lifecycle(a.connections, lifecycle, a.expiring)
    if "tls" in sections:
        tls_cost.print_tls(a.tls_calls, a.tls_rounds, tls_results)
    if "dns" in sections:
        print_dns(a.dns_calls, a.dns_queries, dns_results)
    for s in skipped:
        print(f"\n{s}")
    if "send" in sections:
        print("\n(empty program: programs that return at once, attached where the nettap program beside them is: "
              "for tracepoints, every syscall that program serves (write and sendto; 4 exits), so both count "
              "the node's other calls there too; "
              "goals: filtered out <= empty + 20 ns per run, captured 64 B <= 400 ns enter+exit, "
              "sampled out <= filtered out + 20 ns)")


if __name__ == "__main__":
    main()
