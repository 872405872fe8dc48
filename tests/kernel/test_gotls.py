"""Go's crypto/tls in plaintext: the real uprobes of bpf/gotls.bpf.c on Go
programs built by the test from tests/go/gotls with Debian's Go
(tests/gobuild.py), driven over loopback, compared byte for byte with what
the programs sent; and the TLS uprobes only on files the targets' processes
use (an uncaptured Go or Python TLS process pays no trap: the programs' own
run counts, from the kernel's BPF statistics, do not move)."""
import os
import subprocess
import sys
from collections import defaultdict

import base64
import pytest

from exporter.commands import cli
from exporter.config import MAX_PAYLOAD_BYTES
from exporter.kernel import bpfstats, gotls, tls
from helpers import move_to_cgroup, scratch_cgroup
from procs import wait_for
from conftest import emulated, streams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gobuild  # noqa: E402

pytestmark = [pytest.mark.skipif(not tls.supported()[0], reason="no uprobes on this kernel"),
              pytest.mark.usefixtures("tls_mech")]

# One Write a message: 1 byte, a chunk's 396, a TLS record and one byte (two
# records), and 1 MiB (64 records; captured up to max_payload_bytes a call).
SIZES = (1, 396, 16385, 1 << 20)
GO_CAPTURE = {"max_payload_bytes": MAX_PAYLOAD_BYTES, "tls": True}


@pytest.fixture(scope="module")
def go_bins():
    # built here, or before the guest booted where its root has no Go (the arm64 guests)
    try:
        return {v: gobuild.build("gotls", v) for v in gobuild.KERNEL_VARIANTS}
    except RuntimeError as e:
        pytest.fail(str(e))


def spawn(args, wait=False, **kw):
    """A Go program; with wait, running (it said "ready": once Popen returns
    its exec may still be mapping the executable) and waiting for a line."""
    p = subprocess.Popen([*args, *(["-wait"] if wait else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, **kw)
    if wait:
        assert p.stdout.readline() == "ready\n"
    return p


def server(binary, mode, cert, tls12=False):
    """A Go TLS server (echo-server or https-server) and its port."""
    p = spawn([binary, mode, "-cert", cert[0], "-key", cert[1], *(["-tls12"] if tls12 else [])])
    line = p.stdout.readline().split()
    assert line[:1] == ["listening"], line
    return p, int(line[1])


def finish(p, timeout=None):
    out, _ = p.communicate(timeout=timeout or emulated(60, 600))
    assert p.returncode == 0, out
    return out


def go_lines(lines):
    return [l for l in lines if l["type"] == "chunk" and "go" in l["flags"]]


def check_stream(chunks, want: bytes, cap: int = MAX_PAYLOAD_BYTES):
    """Every chunk's bytes are want's at its offset, and each call's first
    min(call_len, cap) bytes are there, the calls covering want in order."""
    have = {}
    calls = {}
    for l in chunks:
        data = base64.b64decode(l["data"])
        assert data == want[l["offset"]:l["offset"] + len(data)], (l["offset"], l["len"])
        have[l["offset"]] = len(data)
        calls[l["call_offset"]] = l["call_len"]
    at = 0
    for off in sorted(calls):
        assert off == at, f"a call missing at {at}"
        pos, end = off, off + min(calls[off], cap)
        while pos < end and pos in have:
            pos += have[pos]
        assert pos == end, (off, pos, calls[off])
        at += calls[off]
    assert at == len(want)


def by_conn(lines, direction):
    out = defaultdict(list)
    for l in lines:
        if l["direction"] == direction:
            out[l["conn_id"]].append(l)
    return out


def test_go_tls_echo_of_a_pid_target(nettap_run, mode, cert, go_bins):
    """A raw tls.Dial echo (TLS 1.3; 1.2 is the HTTPS test's); the client (a
    pid target) alone is captured: its plaintext on its TCP connection, the
    server's (uncaptured) nowhere. Once per mechanism: the TLS chunks' conn_id
    is the one the TCP probes gave the connection."""
    run = nettap_run({"captures": [], "capture": GO_CAPTURE})
    # The module's nettap started without TLS: its programs were loaded when
    # this config turned it on, in an object of their own sharing the loaded
    # object's maps (loader.Probes._load_tls), as the DNS programs are.
    probes = run.app.probes
    assert probes.tls_obj and not probes.tls_deferred
    assert set(tls.programs(probes.variant) + gotls.programs(probes.variant)) <= set(probes.prog_fds)
    before = run.counters()
    srv, port = server(go_bins["plain"], "echo-server", cert)
    try:
        cl = spawn([go_bins["plain"], "echo-client", "-addr", f"127.0.0.1:{port}",
                    "-sizes", ",".join(map(str, SIZES))], wait=True)
        run.apply({"captures": [{"pid": cl.pid}], "capture": GO_CAPTURE})
        cl.stdin.write("go\n")
        cl.stdin.flush()
        assert finish(cl).splitlines()[-1] == "done"
    finally:
        srv.kill()
        srv.wait()
    c = run.counters()
    lines, _ = run.finish()
    gl = go_lines(lines)
    assert {l["pid"] for l in gl} == {cl.pid} and all("tls" in l["flags"] for l in gl)
    sent = b"".join(gobuild.msg(i, n) for i, n in enumerate(SIZES))
    (conn, out), = by_conn(gl, "egress").items()
    (conn_in, inn), = by_conn(gl, "ingress").items()
    assert conn == conn_in != 0
    check_stream(out, sent)
    check_stream(inn, sent)
    # the TLS chunks' connection is the client's TCP connection, whose bytes are ciphertext
    tcp = [l for l in lines if l["type"] == "chunk" and "tls" not in l["flags"] and l["conn_id"] == conn]
    assert tcp and {l["dport"] for l in tcp} == {port}
    ciphertext = streams(tcp, "egress")[conn]
    assert gobuild.msg(3, 1 << 20)[:64] not in ciphertext and len(ciphertext) > len(sent)
    w, r = c["go_tls_write"], c["go_tls_read"]
    assert w["bytes"] - before["go_tls_write"]["bytes"] == len(sent)
    assert r["bytes"] - before["go_tls_read"]["bytes"] == len(sent)
    assert w["calls"] - before["go_tls_write"]["calls"] >= len(SIZES)


@pytest.mark.per_variant
def test_go_https_clients_and_nettap_read(nettap_run, mode, cert, go_bins, capsys, tmp_path):
    """net/http over TLS, two clients of one server, one in TLS 1.3 and one
    forced to 1.2 (its MaxVersion): each one's requests and responses in
    plaintext on its connection; nettap read shows them as the connection's
    TLS streams, --pcap too."""
    run = nettap_run({"captures": [], "capture": GO_CAPTURE})
    srv, port = server(go_bins["plain"], "https-server", cert)
    try:
        clients = [spawn([go_bins["plain"], "https-get", "-url", f"https://127.0.0.1:{port}/size/5000", "-n", "3",
                          *flag], wait=True) for flag in ([], ["-tls12"])]
        run.apply({"captures": [{"pid": c.pid} for c in clients], "capture": GO_CAPTURE})
        for c in clients:
            c.stdin.write("go\n")
            c.stdin.flush()
            assert finish(c).splitlines() == ["status 200 5000"] * 3 + ["done"]
    finally:
        srv.kill()
        srv.wait()
    lines, _ = run.finish()
    gl = go_lines(lines)
    assert {l["pid"] for l in gl} == {c.pid for c in clients}
    for c in clients:
        mine = [l for l in gl if l["pid"] == c.pid]
        (req,), (resp,) = streams(mine, "egress", tls=True).values(), streams(mine, "ingress", tls=True).values()
        assert req.count(b"GET /size/5000 HTTP/1.1\r\n") == 3
        assert resp.count(b"HTTP/1.1 200 OK\r\n") == 3 and resp.count(gobuild.msg(0, 5000)) == 3
    conn = gl[0]["conn_id"]
    capsys.readouterr()
    assert cli.main(["read", str(run.out), "--conn", str(conn)]) == 0
    text = capsys.readouterr().out
    assert "==> tls egress 127.0.0.1:" in text and "GET /size/5000 HTTP/1.1" in text
    pcap = tmp_path / "go.pcap"
    assert cli.main(["read", str(run.out), "--conn", str(conn), "--pcap", str(pcap)]) == 0
    assert f"conn {conn}: its TLS plaintext (decrypted" in capsys.readouterr().err
    assert b"GET /size/5000 HTTP/1.1\r\n" in pcap.read_bytes()


@pytest.mark.per_variant
def test_a_stripped_go_program_started_after_nettap_is_ready(nettap_run, mode, cert, go_bins):
    """A cgroup target; the stripped binary (.gopclntab, the offsets' table)
    started in it afterwards is attached from its exec record alone."""
    with scratch_cgroup() as cg:
        run = nettap_run({"captures": [{"cgroup": cg}], "capture": GO_CAPTURE})
        srv, port = server(go_bins["plain"], "echo-server", cert)
        try:
            cl = spawn([go_bins["stripped"], "echo-client", "-addr", f"127.0.0.1:{port}", "-sizes", "396,5000"],
                       wait=True, preexec_fn=lambda: move_to_cgroup(cg, os.getpid()))
            files = run.app.probes.tls.files
            wait_for(lambda: os.path.realpath(go_bins["stripped"]) in files.values(), emulated(10, 120),
                     what="the stripped binary attached")
            cl.stdin.write("go\n")
            cl.stdin.flush()
            finish(cl)
        finally:
            srv.kill()
            srv.wait()
        lines, _ = run.finish()
    gl = go_lines(lines)
    assert {l["pid"] for l in gl} == {cl.pid}
    sent = gobuild.msg(0, 396) + gobuild.msg(1, 5000)
    assert list(streams(gl, "egress", tls=True).values()) == [sent]
    assert list(streams(gl, "ingress", tls=True).values()) == [sent]


def uprobe_runs(app) -> int:
    """Runs of every TLS uprobe program (libssl's, Go's) so far."""
    names = [n for n in app.probes.prog_fds if n in tls.programs("fast") + tls.programs("compat")
             + gotls.programs("fast") + gotls.programs("compat") and n not in (tls.MMAP, gotls.EXEC)]
    return sum(bpfstats.prog_info(app.probes.prog_fds[n]).run_cnt for n in names)


PY_CLIENT = r"""
import socket, ssl, sys
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(sys.argv[1]))))
for _ in range(5):
    s.sendall(b"x" * 1000); n = 0
    while n < 1000:
        n += len(s.recv(1000 - n))
s.close()
"""


@pytest.mark.per_variant
def test_uncaptured_go_and_python_tls_pay_no_trap(nettap_run, mode, cert, go_bins):
    """A pid target runs the plain binary: only that file is attached. A Go
    process of another binary (the PIE build) and a Python TLS client, both
    uncaptured, make TLS calls: no uprobe of nettap runs (the kernel's run
    counts of every TLS program stand still) and neither adds a record."""
    doc = {"captures": [], "capture": GO_CAPTURE, "diagnostics": {"bpfStats": {"enabled": True}}}
    run = nettap_run(doc)
    srv, port = server(go_bins["pie"], "echo-server", cert)
    idle = spawn([go_bins["plain"], "echo-client", "-addr", f"127.0.0.1:{port}", "-sizes", "10"], wait=True)
    try:
        run.apply({**doc, "captures": [{"pid": idle.pid}]})
        attached = set(run.app.probes.tls.files.values())
        assert attached == {os.path.realpath(go_bins["plain"])}, attached
        start = uprobe_runs(run.app)
        other = spawn([go_bins["pie"], "echo-client", "-addr", f"127.0.0.1:{port}", "-sizes", "1,400"])
        assert finish(other).splitlines()[-1] == "done"
        subprocess.run([sys.executable, "-c", PY_CLIENT, str(port)], check=True, timeout=emulated(60, 600))
        assert uprobe_runs(run.app) == start
        idle.stdin.write("go\n")             # the captured one: its calls do run them
        idle.stdin.flush()
        finish(idle)
        assert uprobe_runs(run.app) > start
    finally:
        for p in (srv, idle):
            p.kill()
            p.wait()
    lines, _ = run.finish()
    assert {l["pid"] for l in go_lines(lines)} == {idle.pid}
    assert {l["pid"] for l in lines if l["type"] == "chunk"} == {idle.pid}


PY_HTTPS = r"""
import http.client, ssl, sys
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
c = http.client.HTTPSConnection("127.0.0.1", int(sys.argv[1]), context=ctx)
for i in range(3):
    c.request("GET", "/size/%d" % (100 + i)); assert len(c.getresponse().read()) == 100 + i
    print("got", flush=True); sys.stdin.readline()
"""


@pytest.mark.per_variant
def test_a_go_read_in_flight_when_attached_is_counted(nettap_run, mode, cert, go_bins):
    """A Go HTTPS server whose keep-alive connection's goroutine waits inside
    (*Conn).Read when its process is named: that read was entered before
    the uprobes, so it returns with nothing to publish, and is counted
    (map_insert_failures{map="go_tls_calls"}); the next ones are captured."""
    run = nettap_run({"captures": [], "capture": GO_CAPTURE})
    srv, port = server(go_bins["plain"], "https-server", cert)
    cl = subprocess.Popen([sys.executable, "-c", PY_HTTPS, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
    try:
        assert cl.stdout.readline() == "got\n"         # the server's goroutine is back inside Read
        before = run.app.map_insert_failures()["go_tls_calls"]
        run.apply({"captures": [{"pid": srv.pid}], "capture": GO_CAPTURE})
        for _ in range(2):
            cl.stdin.write("\n")
            cl.stdin.flush()
            assert cl.stdout.readline() == "got\n"
        cl.stdin.write("\n")
        cl.stdin.close()
        assert cl.wait(timeout=emulated(60, 600)) == 0
        assert run.app.map_insert_failures()["go_tls_calls"] - before == 1
    finally:
        srv.kill()
        srv.wait()
        cl.kill()
        cl.stdout.close()
    lines, _ = run.finish()
    resp = b"".join(streams(go_lines(lines), "egress", tls=True).values())
    req = b"".join(streams(go_lines(lines), "ingress", tls=True).values())
    # the second request was read by the call in flight; the third read, both responses captured
    assert resp.count(b"HTTP/1.1 200 OK\r\n") == 2 and gobuild.msg(0, 101) in resp and gobuild.msg(0, 102) in resp
    assert b"GET /size/102 HTTP/1.1\r\n" in req and b"GET /size/101" not in req
