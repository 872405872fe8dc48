"""Kernel test of `nettap read`: a real nettap captures a real request and
reply exchange on loopback into rotated JSON-lines files; `nettap read`
lists it and writes a pcap, and tshark's "Follow TCP stream" of that pcap
gives back exactly the bytes each side sent."""
import glob
import socket
import threading
import time

import dpkt
import pytest

from conftest import emulated
from exporter.commands import cli
from helpers import tshark_follow
from traffic import payload


ROUNDS, REQ, REP = 20, 1000, 700


def _recv_exactly(s, n):
    buf = b""
    while len(buf) < n:
        d = s.recv(n - len(buf))
        assert d, f"peer closed after {len(buf)} of {n} bytes"
        buf += d
    return buf


class Exchange:
    """A loopback server (listening once made) and, in run(), its client:
    ROUNDS requests of REQ bytes, each answered with REP bytes, the server's
    goodbye, then the client closes first. (Every byte is read before either
    socket reaches TCP_CLOSE: a client that closed first and still reads
    would be in TIME_WAIT, its socket closed, when it reads the last bytes.)"""

    def __init__(self, family, host):
        self.family, self.host = family, host
        self.srv = socket.socket(family)
        self.srv.bind((host, 0))
        self.srv.listen(1)
        self.port = self.srv.getsockname()[1]
        self.client, self.server = [], []          # what each side sent
        self.cport = None

    def _serve(self):
        c, _ = self.srv.accept()
        with c:
            for i in range(ROUNDS):
                _recv_exactly(c, REQ)
                self.server.append(payload(REP, seed=100 + i))
                c.sendall(self.server[-1])
            self.server.append(b"bye\n")
            c.sendall(b"bye\n")
            assert c.recv(1) == b""

    def run(self):
        t = threading.Thread(target=self._serve)
        t.start()
        with socket.socket(self.family) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.connect((self.host, self.port))
            self.cport = s.getsockname()[1]
            for i in range(ROUNDS):
                self.client.append(payload(REQ, seed=i))
                s.sendall(self.client[-1])
                _recv_exactly(s, REP)
            assert _recv_exactly(s, 4) == b"bye\n"
        t.join(10)
        self.srv.close()
        return b"".join(self.client), b"".join(self.server)


def nettap_read(capsys, *args):
    """`nettap read` in this process (tests/unit/test_read.py runs the CLI as
    a process; an interpreter start costs ~10 s in the emulated guests)."""
    capsys.readouterr()
    rc = cli.main(["read", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def follow(pcap, stream):
    """tshark's Follow TCP stream (raw): {"addr:port": bytes that end sent};
    in the emulated guests, where tshark takes ~30 s to start, the same
    reassembled from the pcap with dpkt (what the pcap holds does not
    depend on the kernel: the capture it is made from does)."""
    if emulated(True, False):
        return dict(tshark_follow(pcap, stream, timeout=120).values())
    return _follow_dpkt(pcap)


def _follow_dpkt(pcap):
    sent = {}
    with open(pcap, "rb") as f:
        for _, pkt in dpkt.pcap.Reader(f):
            ip = dpkt.ip6.IP6(pkt) if pkt[0] >> 4 == 6 else dpkt.ip.IP(pkt)
            tcp = ip.data
            if not tcp.data:
                continue
            af = socket.AF_INET6 if pkt[0] >> 4 == 6 else socket.AF_INET
            addr = socket.inet_ntop(af, ip.src)
            src = f"[{addr}]:{tcp.sport}" if af == socket.AF_INET6 else f"{addr}:{tcp.sport}"
            sent.setdefault(src, []).append((tcp.seq, bytes(tcp.data)))
    out = {}
    for src, segs in sent.items():
        buf = b""
        for seq, data in sorted(segs):
            assert seq - 1 == len(buf), f"{src}: a gap or overlap at {seq - 1}"
            buf += data
        out[src] = buf
    return out


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")],
                         ids=["ipv4", "ipv6"])
def test_pcap_of_a_real_capture_follows_back_to_the_bytes_sent(nettap_run, tmp_path, capsys, family, host):
    """With the mechanism nettap picks here: each mechanism's bytes are
    checked by test_capture's byte-exact tests; this one checks the reader."""
    ex = Exchange(family, host)
    # every byte captured (65736 a call), in files rotated at 32 KiB: the exchange spans several
    run = nettap_run({"captures": [{"port": ex.port}], "capture": {"max_payload_bytes": 65736},
                      "output": {"type": "jsonl", "path": str(tmp_path / "capture.jsonl"), "root": str(tmp_path),
                                 "max_bytes": 32768, "backups": 50}})
    client_bytes, server_bytes = ex.run()
    run.finish()
    files = sorted(glob.glob(str(tmp_path / "capture.jsonl*")))   # the shell's order: newest first
    assert len(files) >= 3, files

    rc, out, err = nettap_read(capsys, *files)
    assert (rc, err) == (0, ""), err
    ep = (lambda p: f"[{host}]:{p}") if family == socket.AF_INET6 else (lambda p: f"{host}:{p}")
    # both ends are captured, the client's socket and the server's, each with every byte
    rows = [l.split() for l in out.splitlines()[1:3]]
    assert sorted((r[1], r[2], int(r[5]), int(r[6]), r[7], r[8], r[9]) for r in rows) == sorted([
        (ep(ex.cport), ep(ex.port), len(client_bytes), len(server_bytes), "-", "-", "yes"),
        (ep(ex.port), ep(ex.cport), len(server_bytes), len(client_bytes), "-", "-", "yes")])
    assert out.splitlines()[3].startswith("2 connection(s) of 2; ")

    pcap = tmp_path / "out.pcap"
    rc, _, err = nettap_read(capsys, *files, "--pcap", str(pcap))
    assert rc == 0, err
    assert "is the other end of conn" in err        # one TCP connection, captured at both ends: once
    assert follow(pcap, 0) == {ep(ex.cport): client_bytes, ep(ex.port): server_bytes}
    with open(pcap, "rb") as f:                      # dated now (the clock track's wall time), not since boot
        first = float(next(iter(dpkt.pcap.Reader(f)))[0])
    assert abs(first - time.time()) < 600, first
    for conn in {r[0] for r in rows}:                # and each end alone
        rc, _, err = nettap_read(capsys, *files, "--conn", conn, "--pcap", str(pcap))
        assert rc == 0 and "other end" not in err, err
        assert follow(pcap, 0) == {ep(ex.cport): client_bytes, ep(ex.port): server_bytes}
