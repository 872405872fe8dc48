"""`nettap read`: the committed capture files of tests/unit/fixtures/read
(made by the reference JSON-lines writer) read back: rotation order,
listing, streams as text and hex with truncation and gaps marked, filters,
bad lines, and the pcap, read back by dpkt and followed by tshark."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dpkt
import pytest

from exporter.commands import cli, missed, pcap, streams
from helpers import tshark_follow

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).resolve().parent / "fixtures" / "read"
_spec = importlib.util.spec_from_file_location("read_fixture", FIX / "make_fixture.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
NEWEST_FIRST = [str(FIX / n) for n in ("capture.jsonl", "capture.jsonl.1", "capture.jsonl.2")]


def nettap(*args, cwd=FIX):
    """The real CLI in a process: (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "exporter", *args], cwd=cwd, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def run(capsys, *args):
    """cli.main in this process: (exit code, stdout, stderr)."""
    rc = cli.main(["read", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_fixture_files_are_the_writers_lines():
    for name, data in zip(make.NAMES, make.files()):
        assert (FIX / name).read_bytes() == data, f"{name} is stale: run {FIX / 'make_fixture.py'}"


def test_rotated_sets_are_ordered_oldest_first():
    assert streams.ordered(["c.jsonl", "c.jsonl.1", "c.jsonl.10", "c.jsonl.2"]) == \
        ["c.jsonl.10", "c.jsonl.2", "c.jsonl.1", "c.jsonl"]
    # two sets, each in its own order, in the order their first file was named; duplicates once
    assert streams.ordered(["b/x.1", "a/x", "b/x", "a/x.2", "b/x.1", "a/x.1"]) == \
        ["b/x.1", "b/x", "a/x.2", "a/x.1", "a/x"]


LISTING = """\
CONN  LOCAL                REMOTE             PID   COMM     TX    RX    TRUNCATED       GAPS      CLOSED  TLS
1     192.0.2.1:40000      198.51.100.2:80    1000  curl     48    1000  -               -         yes     -
2     [2001:db8::1]:50000  [2001:db8::2]:443  2000  python3  5104  605   1 call, 4000 B  1, 300 B  no      -
3     127.0.0.1:8080       127.0.0.1:41000    3000  nginx    7     206   -               1, 200 B  yes     -
1     192.0.2.1:40001      198.51.100.2:80    1001  curl     5     0     -               -         no      -
4 connection(s) of 4; records: 16 chunk, 2 eof, 1 log
1 chunk(s) without a connection (conn_id 0: nettap's connection table was full): in no stream
log records: conn_table_full 1
"""
SKIPPED = ('nettap read: skipped 4 line(s): 1 not JSON (first: capture.jsonl.2:3); 1 of unknown type '
           '"metric" (first: capture.jsonl.1:9); 1 chunk record(s) whose data is not base64 (first: '
           'capture.jsonl.1:10); 1 cut last line (first: capture.jsonl:8)\n')


def test_listing_reads_the_rotated_set_in_order_whatever_the_command_line_order():
    # the shell's glob order (capture.jsonl first) and newest first: the same, oldest first
    for files in (["capture.jsonl", "capture.jsonl.1", "capture.jsonl.2"],
                  ["capture.jsonl.1", "capture.jsonl.2", "capture.jsonl"]):
        rc, out, err = nettap("read", *files)
        assert (rc, out, err) == (0, LISTING, SKIPPED)


def test_bad_input_is_counted_in_one_line_never_a_traceback(tmp_path, capsys):
    good = (FIX / "capture.jsonl.2").read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join([
        good[0],
        b"\n",                                          # empty
        b"\xff\xfe\x00binary\n",                        # not UTF-8
        b"[1, 2]\n", b"42\n", b"null\n",                # JSON, not objects
        b'{"no":"type"}\n',
        b'{"type":"chunk"}\n',                          # no fields
        good[1].replace(b'"offset":0', b'"offset":-5'),
        good[1].replace(b'"direction":"egress"', b'"direction":"sideways"'),
        good[1].replace(b'"len":100', b'"len":99'),     # data is not len bytes
        good[1].replace(b'"conn_id":2', b'"conn_id":true'),
        good[1][:-30] + b"\n",                          # cut, then more lines
        good[3][:40],                                   # cut last line
    ]))
    rc, out, err = nettap("read", str(bad), str(tmp_path / "absent.jsonl"))
    assert rc == 1                                      # a file could not be read
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines[0] == f"nettap read: cannot read {tmp_path / 'absent.jsonl'}: No such file or directory"
    assert len(lines) == 2 and lines[1].startswith("nettap read: skipped 13 line(s): 3 not JSON (first: ")
    for reason in ("3 not a JSON object", '1 of unknown type null', "2 chunk record(s) with a missing or bad",
                   "1 chunk record(s) with a bad direction", "1 chunk record(s) whose data is not len bytes",
                   f"1 cut last line (first: {bad}:14)"):
        assert reason in lines[1]
    assert out.splitlines()[1].startswith("1     192.0.2.1:40000")       # the good line is read
    assert out.splitlines()[-1] == "1 connection(s) of 1; records: 1 chunk, 0 eof, 0 log"


def test_clock_lines_that_lost_records_are_reported_with_their_window(tmp_path, capsys):
    """Issue 26's clock track: a window whose clock line counts drops (in the
    kernel) or losses (after the rings) is named, from the line before it;
    state lines are counted; neither is a connection."""
    good = (FIX / "capture.jsonl.2").read_bytes().splitlines(keepends=True)
    clock = '{{"drops":{{"capture_chunks":{d},"logs":0}},"lost":{{"decode":0,"queue":{q},"sink":0}},' \
            '"real_ns":{r},"ts_ns":{m},"type":"clock"}}\n'
    f = tmp_path / "c.jsonl"
    f.write_bytes(b"".join([
        clock.format(d=0, q=0, r=1_764_000_000_000_000_000, m=5).encode(),
        good[0],
        b'{"conn_id":1,"daddr":"198.51.100.2","dport":80,"family":"ipv4","netns":1,"newstate":"FIN_WAIT1",'
        b'"oldstate":"ESTABLISHED","pid":1000,"saddr":"192.0.2.1","sport":40000,"ts_ns":6,"type":"state"}\n',
        clock.format(d=7, q=2, r=1_764_000_001_000_000_000, m=1_000_000_005).encode(),
        clock.format(d=0, q=0, r=1_764_000_002_000_000_000, m=2_000_000_005).encode(),
    ]))
    rc, out, err = run(capsys, str(f))
    assert (rc, err) == (0, "")
    assert out.splitlines()[-2:] == [
        "1 connection(s) of 1; records: 1 chunk, 0 eof, 0 log, 1 state",
        "records lost: 7 dropped in the kernel and 2 after the rings, from 2025-11-24T16:00:00.000000Z "
        "to 2025-11-24T16:00:01.000000Z"]


def test_a_connections_life_is_shown_before_its_streams(tmp_path, capsys):
    """Issue 26: a connection's state, owner, reset, error and destroy lines
    are counted in the listing and, with --conn, shown in time order (the
    file's order may differ) at their time after the first."""
    life = [
        '{"conn_id":9,"daddr":"192.0.2.2","dport":80,"family":"ipv4","netns":1,"newstate":"SYN_SENT",'
        '"oldstate":"CLOSE","pid":1,"saddr":"0.0.0.0","sport":0,"ts_ns":500,"type":"state"}',
        '{"cgroup_id":42,"comm":"curl","conn_id":9,"daddr":"192.0.2.2","dport":80,"family":"ipv4","netns":1,'
        '"pid":1,"saddr":"0.0.0.0","sport":0,"tid":3,"ts_ns":600,"type":"owner","via":"connect"}',
        '{"conn_id":9,"daddr":"192.0.2.2","direction":"ingress","dport":80,"family":"ipv4","netns":1,"pid":1,'
        '"saddr":"192.0.2.1","sport":40000,"state":"ESTABLISHED","ts_ns":2000500,"type":"reset"}',
        '{"conn_id":9,"daddr":"192.0.2.2","dport":80,"errno":104,"errno_name":"ECONNRESET","family":"ipv4",'
        '"netns":1,"pid":1,"saddr":"192.0.2.1","sport":40000,"state":"CLOSE","ts_ns":2000700,"type":"error"}',
        '{"bytes_acked":5,"bytes_received":0,"conn_id":9,"daddr":"192.0.2.2","dport":80,"family":"ipv4",'
        '"netns":1,"pid":1,"saddr":"192.0.2.1","segs_in":2,"segs_out":3,"sport":40000,"state":"CLOSE",'
        '"total_retrans":0,"ts_ns":3000500,"type":"destroy"}',
    ]
    f = tmp_path / "c.jsonl"
    f.write_bytes(b"".join([life[2].encode() + b"\n", _chunk(), *(l.encode() + b"\n" for l in life[:2] + life[3:])]))
    rc, out, err = run(capsys, str(f))
    assert (rc, err) == (0, "")
    assert out.splitlines()[-1] == ("1 connection(s) of 1; records: 1 chunk, 0 eof, 0 log, 1 state, 1 reset, "
                                    "1 owner, 1 error, 1 destroy")
    rc, out, err = run(capsys, str(f), "--conn", "9")
    assert (rc, err) == (0, "")
    assert out.splitlines()[1:6] == [
        "  +0.000 ms  CLOSE -> SYN_SENT",
        "  +0.000 ms  owner pid 1 tid 3 (curl), cgroup 42, learnt at its connect",
        "  +2.000 ms  reset received in ESTABLISHED",
        "  +2.000 ms  error ECONNRESET in CLOSE",
        "  +3.000 ms  destroyed in CLOSE: 5 B acknowledged, 0 B received, 3 segments out, 2 in, 0 retransmitted"]
    assert out.splitlines()[6].startswith("==> egress 192.0.2.1:40000 -> 192.0.2.2:80: 4 bytes")


def test_a_sampled_owner_names_its_rate(tmp_path, capsys):
    """capture.sample_connections: the owner's sample is in the listing and
    the connection's life; an owner line written before the field existed
    (the test above) reads as 1 in 1."""
    owner = ('{"cgroup_id":42,"comm":"curl","conn_id":9,"daddr":"192.0.2.2","dport":80,"family":"ipv4",'
             '"netns":1,"pid":1,"sample":4,"saddr":"192.0.2.1","sport":40000,"tid":3,"ts_ns":600,'
             '"type":"owner","via":"connect"}\n')
    f = tmp_path / "c.jsonl"
    f.write_bytes(_chunk() + owner.encode())
    rc, out, err = run(capsys, str(f))
    assert (rc, err) == (0, "")
    assert out.splitlines()[-1] == "sampled: 1 in 4 connections (1 owner record(s))"
    rc, out, err = run(capsys, str(f), "--conn", "9")
    assert "learnt at its connect, 1 in 4 connections sampled" in out


def test_a_pods_owner_is_named_in_the_life_and_the_pcapng_comment(tmp_path, capsys):
    """Issue 51: an owner line with its pod and container (docs/kubernetes.md)
    names them in the connection's life, and a pcap of it is pcapng with
    them in its first packet's comment; without the names, the ids."""
    uid, cid = "0b6e4a3c-5f2d-4e8a-9c1b-7a2d3e4f5a6b", "2" * 64
    owner = ('{"cgroup_id":42,"comm":"curl","conn_id":9,"container":"api","container_id":"%s","daddr":"192.0.2.2",'
             '"dport":80,"family":"ipv4","namespace":"shop","netns":1,"pid":1,"pod":"checkout-1","pod_uid":"%s",'
             '"sample":1,"saddr":"192.0.2.1","sport":40000,"tid":3,"ts_ns":600,"type":"owner","via":"connect"}\n'
             % (cid, uid))
    f = tmp_path / "c.jsonl"
    f.write_bytes(_chunk() + owner.encode())
    rc, out, err = run(capsys, str(f), "--conn", "9")
    assert (rc, err) == (0, "")
    text = f"pod shop/checkout-1 (uid {uid}), container api (id 222222222222)"
    assert f"learnt at its connect, {text}" in out
    rc, out, err = run(capsys, str(f), "--pcap", str(tmp_path / "p.pcap"))
    assert rc == 0, err
    # tshark reads each packet's comment (frame.comment): only the first packet's is set
    p = subprocess.run(["tshark", "-r", str(tmp_path / "p.pcap"), "-T", "fields", "-e", "frame.comment"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    comments = p.stdout.splitlines()
    assert len(comments) > 3 and comments[0] == f"nettap conn 9: {text}" and not any(comments[1:])
    f.write_bytes(_chunk() + owner.replace('"container":"api",', "").replace('"namespace":"shop",', "")
                  .replace('"pod":"checkout-1",', "").encode())
    rc, out, err = run(capsys, str(f), "--conn", "9")
    assert f"learnt at its connect, pod uid {uid}, container id 222222222222" in out


def test_a_pod_names_its_own_connection_across_a_restart(tmp_path, capsys):
    """conn ids restart at 1 with each nettap run: the pcapng comment names
    the pod of the connection (its addresses and ports too) whose owner line
    it was, not another run's connection with the same conn_id; an owner line
    made at a connect, before its local port, names the next one read."""
    uid = "0b6e4a3c-5f2d-4e8a-9c1b-7a2d3e4f5a6b"
    owner = ('{"cgroup_id":42,"comm":"curl","conn_id":9,"daddr":"192.0.2.2","dport":80,"family":"ipv4",'
             '"netns":1,"pid":1,"pod_uid":"%s","sample":1,"saddr":"192.0.2.1","sport":%d,"tid":3,"ts_ns":%d,'
             '"type":"owner","via":"connect"}\n')
    f = tmp_path / "c.jsonl"
    other = uid.replace("0b", "1c")
    runs = [(owner % (uid, 40000, 600)).encode() + _chunk(),                      # run 1: conn 9 of the pod
            _chunk(sport=40001, ts_ns=5000),                                      # run 2: conn 9, no pod
            _chunk(sport=40002, ts_ns=9000) + (owner % (other, 0, 8000)).encode(),  # run 3: its chunk first
            (owner % (uid, 0, 9500)).encode() + _chunk(sport=40003, ts_ns=9900)]    # run 4: its owner first
    f.write_bytes(b"".join(runs))
    rc, out, err = run(capsys, str(f), "--pcap", str(tmp_path / "p.pcap"))
    assert rc == 0, err
    p = subprocess.run(["tshark", "-r", str(tmp_path / "p.pcap"), "-T", "fields", "-e", "tcp.srcport",
                        "-e", "frame.comment"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    comments = {}
    for line in p.stdout.splitlines():
        port, _, comment = line.partition("\t")
        if comment:
            comments.setdefault(port, []).append(comment)
    assert comments == {"40000": [f"nettap conn 9: pod uid {uid}"], "40002": [f"nettap conn 9: pod uid {other}"],
                        "40003": [f"nettap conn 9: pod uid {uid}"]}


def test_text_stream_marks_the_truncated_call_and_the_gap(capsys):
    rc, out, err = run(capsys, *NEWEST_FIRST, "--conn", "2")
    assert rc == 0
    lines = out.split("\n")
    assert lines[0] == "conn 2: ipv6 [2001:db8::1]:50000 -> [2001:db8::2]:443, pid 2000 (python3)"
    assert lines[1] == "==> egress [2001:db8::1]:50000 -> [2001:db8::2]:443: 5104 bytes in 3 call(s), 1104 captured"
    assert lines[2].startswith("A" * 100)               # call 1, then call 2's first 1000 bytes
    trunc = ("[nettap: 4000 bytes not captured at offset 1100: the call of 5000 bytes at offset 100 "
             "was truncated (capture.max_payload_bytes)]")
    i = lines.index(trunc)
    assert lines[i + 1:i + 3] == ["bye", "==> ingress [2001:db8::2]:443 -> [2001:db8::1]:50000: "
                                  "605 bytes in 2 call(s), 305 captured"]
    assert lines[i + 3:] == ["R" * 300, "[nettap: 300 bytes missing at offset 300 (records lost)]", "tail", ""]


def test_text_shows_utf8_and_control_bytes_as_wireshark_does(capsys):
    rc, out, _ = run(capsys, *NEWEST_FIRST, "--conn", "1", "--port", "40000")
    assert rc == 0
    assert out.startswith("conn 1: ipv4 192.0.2.1:40000 -> 198.51.100.2:80, pid 1000 (curl), closed\n"
                          "==> egress 192.0.2.1:40000 -> 198.51.100.2:80: 48 bytes in 1 call(s), 48 captured\n"
                          "GET /index.html HTTP/1.1\r\nHost: example.test\r\n\r\n"
                          "==> ingress 198.51.100.2:80 -> 192.0.2.1:40000: 1000 bytes in 1 call(s), 1000 captured\n"
                          "HTTP/1.1 200 OK\r\nContent-Length: 960\r\n\r\n<p>caf\u00e9 \ufffd. ok</p>\n")
    assert out.endswith("!" * 40 + "\n")                # no newline in the data: one is added
    assert "conn 1: ipv4 192.0.2.1:40001" not in out    # the other conn_id 1 has port 40001


def test_hex_stream_marks_unreadable_payload(capsys):
    rc, out, _ = run(capsys, *NEWEST_FIRST, "--conn", "3", "--hex")
    assert (rc, out) == (0, """\
conn 3: ipv4 127.0.0.1:8080 -> 127.0.0.1:41000, pid 3000 (nginx), closed
==> egress 127.0.0.1:8080 -> 127.0.0.1:41000: 7 bytes in 1 call(s), 7 captured
00000000  2b 50 4f 4e 47 0d 0a                              |+PONG..|
==> ingress 127.0.0.1:41000 -> 127.0.0.1:8080: 206 bytes in 2 call(s), 6 captured
[nettap: 200 bytes at offset 0 unreadable (the kernel could not read the payload)]
000000c8  50 49 4e 47 0d 0a                                 |PING..|
""")
    rc, out, _ = run(capsys, *NEWEST_FIRST, "--conn", "1", "--port", "40000", "--hex")
    assert out.split("\n")[2:5] == [
        "00000000  47 45 54 20 2f 69 6e 64  65 78 2e 68 74 6d 6c 20  |GET /index.html |",
        "00000010  48 54 54 50 2f 31 2e 31  0d 0a 48 6f 73 74 3a 20  |HTTP/1.1..Host: |",
        "00000020  65 78 61 6d 70 6c 65 2e  74 65 73 74 0d 0a 0d 0a  |example.test....|"]


def _rows(out):
    return [line.split()[:2] for line in out.splitlines()[1:] if line.split()[1][-1].isdigit()]


@pytest.mark.parametrize("args, rows", [
    (["--port", "443"], [["2", "[2001:db8::1]:50000"]]),
    (["--port", "8080", "--port", "40001"], [["3", "127.0.0.1:8080"], ["1", "192.0.2.1:40001"]]),
    (["--pid", "3000"], [["3", "127.0.0.1:8080"]]),
    (["--port", "80", "--pid", "1001"], [["1", "192.0.2.1:40001"]]),
    (["--port", "9"], []),
])
def test_filters(capsys, args, rows):
    rc, out, _ = run(capsys, *NEWEST_FIRST, *args)
    assert rc == 0 and _rows(out) == rows
    assert out.splitlines()[-3] == f"{len(rows)} connection(s) of 4; records: 16 chunk, 2 eof, 1 log"


def test_conn_id_of_two_connections_prints_both(capsys):
    # conn_id 1 again after a restarted nettap: the addresses tell them apart
    rc, out, _ = run(capsys, *NEWEST_FIRST, "--conn", "1")
    assert rc == 0 and [l for l in out.splitlines() if l.startswith("conn ")] == [
        "conn 1: ipv4 192.0.2.1:40000 -> 198.51.100.2:80, pid 1000 (curl), closed",
        "conn 1: ipv4 192.0.2.1:40001 -> 198.51.100.2:80, pid 1001 (curl)"]


def test_no_matching_connection_is_an_error(capsys):
    rc, out, err = run(capsys, *NEWEST_FIRST, "--conn", "99")
    assert (rc, out) == (1, "") and err.endswith("nettap read: no connection matches\n")


def _packets(path):
    with open(path, "rb") as f:
        r = dpkt.pcap.Reader(f)
        assert r.datalink() == pcap.LINKTYPE_RAW
        return [(float(ts), dpkt.ip6.IP6(buf) if buf[0] >> 4 == 6 else dpkt.ip.IP(buf)) for ts, buf in r]


def test_pcap_ipv6_segments_carry_stream_offsets(tmp_path, capsys):
    out = tmp_path / "c2.pcap"
    rc, _, err = run(capsys, *NEWEST_FIRST, "--port", "443", "--pcap", str(out))
    assert rc == 0 and err.endswith(f"nettap read: wrote 13 packets of 1 connection(s) to {out}\n")
    pk = _packets(out)
    assert all(isinstance(ip, dpkt.ip6.IP6) for _, ip in pk)
    F = dpkt.tcp
    seen = [(ip.data.sport, ip.data.flags, ip.data.seq, ip.data.ack, len(ip.data.data)) for _, ip in pk]
    assert seen[:3] == [(50000, F.TH_SYN, 0, 0, 0), (443, F.TH_SYN | F.TH_ACK, 0, 1, 0), (50000, F.TH_ACK, 1, 1, 0)]
    data = [(s, seq, n) for s, fl, seq, ack, n in seen if n]
    # sequence number = stream offset + 1; the truncated call's tail and the lost call are not sent
    assert data == [(50000, 1, 100), (50000, 101, 1000), (443, 1, 300), (443, 601, 5), (50000, 5101, 4)]
    acks = [(s, ack) for s, fl, seq, ack, n in seen[3:] if not n]
    assert acks == [(443, 101), (443, 5101), (50000, 301), (50000, 606), (443, 5105)]
    assert not any(fl & F.TH_FIN for _, fl, *_ in seen)            # no eof: still open
    ts = [t for t, _ in pk]
    assert ts == sorted(ts) and ts[3] == pytest.approx((make.REAL0 + 1 * make.MS) / 1e9, abs=1e-6)   # wall time


MISSING = "[{} bytes missing in capture file]\0".format


def test_tshark_follows_every_connection_with_the_gaps_it_is_told(tmp_path, capsys):
    assert shutil.which("tshark"), "tshark (Debian's package) is installed by scripts/setup.sh test"
    out = tmp_path / "all.pcap"
    rc, _, err = run(capsys, *NEWEST_FIRST, "--pcap", str(out))
    assert rc == 0 and "wrote 38 packets of 4 connection(s)" in err
    p = subprocess.run(["tshark", "-r", str(out), "-o", "tcp.check_checksum:TRUE", "-o", "ip.check_checksum:TRUE",
                        "-T", "fields", "-e", "tcp.checksum.status"], capture_output=True, timeout=60)
    assert p.stdout.split() == [b"1"] * 38              # every checksum good
    assert tshark_follow(out, 0) == {0: ("192.0.2.1:40000", make.REQUEST), 1: ("198.51.100.2:80", make.RESPONSE)}
    assert tshark_follow(out, 1) == {
        0: ("[2001:db8::1]:50000", b"A" * 100 + make.BIG[:1000] + MISSING(4000).encode() + b"bye\n"),
        1: ("[2001:db8::2]:443", b"R" * 300 + MISSING(300).encode() + b"tail\n")}
    # conn 3's local port 8080 is the lower: the remote end connected, and sends first
    assert tshark_follow(out, 2) == {0: ("127.0.0.1:41000", MISSING(200).encode() + b"PING\r\n"),
                               1: ("127.0.0.1:8080", b"+PONG\r\n")}
    assert tshark_follow(out, 3) == {0: ("192.0.2.1:40001", b"hello"), 1: ("198.51.100.2:80", b"")}


def test_pcap_fins_follow_who_closed_first(tmp_path, capsys):
    out = tmp_path / "fin.pcap"
    run(capsys, *NEWEST_FIRST, "--port", "80", "--port", "8080", "--pcap", str(out))
    fins = [(ip.data.sport, ip.data.seq) for _, ip in _packets(out) if ip.data.flags & dpkt.tcp.TH_FIN]
    # conn 1 was in FIN_WAIT2 (it closed first), conn 3 in LAST_ACK (its peer did)
    assert fins == [(40000, 49), (80, 1001), (41000, 207), (8080, 8)]


def test_pcap_keeps_one_end_of_a_connection_captured_at_both(tmp_path, capsys):
    a = (5, make.V4, "127.0.0.1", 41000, "127.0.0.1", 6000, 10, b"client")
    b = (6, make.V4, "127.0.0.1", 6000, "127.0.0.1", 41000, 10, b"client")
    f = tmp_path / "loop.jsonl"
    f.write_bytes(make.ch(a, make.EGRESS, 0, b"ping", 1000) + make.ch(b, make.INGRESS, 0, b"ping", 2000)
                  + make.ch(b, make.EGRESS, 0, b"pong", 3000) + make.ch(a, make.INGRESS, 0, b"pong", 4000))
    rc, _, err = run(capsys, str(f), "--pcap", str(tmp_path / "loop.pcap"))
    assert rc == 0
    assert err.splitlines() == [
        f"nettap read: {pcap.NO_CLOCK}",                # a file without the clock track
        "nettap read: conn 6 is the other end of conn 5 (the same TCP connection): left out of the pcap",
        f"nettap read: wrote 7 packets of 1 connection(s) to {tmp_path / 'loop.pcap'}"]
    assert tshark_follow(tmp_path / "loop.pcap", 0) == {0: ("127.0.0.1:41000", b"ping"), 1: ("127.0.0.1:6000", b"pong")}


def _times_ns(path) -> list:
    """Each packet's time in a nanosecond pcap, exactly (dpkt's are floats)."""
    import struct
    data, out, at = Path(path).read_bytes(), [], 24
    assert data[:4] == b"\x4d\x3c\xb2\xa1"          # little-endian, nanoseconds
    while at < len(data):
        sec, nsec, caplen, _ = struct.unpack_from("<IIII", data, at)
        out.append(sec * 10**9 + nsec)
        at += 16 + caplen
    return out


def test_pcap_times_are_the_clock_tracks_wall_time(tmp_path, capsys):
    """Each packet at CLOCK_REALTIME by the clock line before it (the first
    line's offset before any): Wireshark shows the capture's date, not 1970."""
    from datetime import datetime, timezone
    out = tmp_path / "c1.pcap"
    rc, _, err = run(capsys, *NEWEST_FIRST, "--port", "80", "--port", "443", "--pcap", str(out))
    assert rc == 0 and pcap.NO_CLOCK not in err, err
    t, pk = _times_ns(out), _packets(out)
    assert len(t) == len(pk) and t == sorted(t)
    first_data = {(ip.data.sport, ip.data.seq): ns for ns, (_, ip) in zip(t, pk) if ip.data.data}
    assert t[0] == make.REAL0 - 3000                    # conn 1's SYN, 3 us before its first call (at REAL0)
    assert first_data[40000, 1] == make.REAL0           # its request, the records' t
    assert first_data[443, 601] == make.REAL0 + 40 * make.MS + make.DRIFT     # after the second clock line
    assert datetime.fromtimestamp(t[0] / 1e9, timezone.utc).date().isoformat() == "2026-12-06"


@pytest.mark.parametrize("flags", [[], ["tls"]], ids=["pcap", "pcapng"])
def test_a_pcap_of_a_capture_made_now_is_dated_today(tmp_path, capsys, flags):
    """A capture whose clock line says now: its first packet is dated today,
    in the pcap and in the pcapng of TLS plaintext alike."""
    import time
    from datetime import datetime, timezone
    real = time.time_ns()
    f = tmp_path / "now.jsonl"
    clock = {"drops": {}, "lost": {}, "real_ns": real, "ts_ns": 7_000_000_000, "type": "clock"}
    f.write_bytes((json.dumps(clock) + "\n").encode() + _chunk(ts_ns=7_000_000_500, flags=flags))
    out = tmp_path / "now.pcap"
    rc, _, err = run(capsys, str(f), "--pcap", str(out))
    assert rc == 0 and pcap.NO_CLOCK not in err, err
    with open(out, "rb") as fh:
        reader = dpkt.pcapng.Reader(fh) if flags else dpkt.pcap.Reader(fh)
        first = float(next(iter(reader))[0])
    assert first == pytest.approx((real + 500 - 3000) / 1e9, abs=1e-6)
    assert datetime.fromtimestamp(first, timezone.utc).date() == datetime.fromtimestamp(real / 1e9, timezone.utc).date()


def _chunk(**kw):
    import json as _json
    rec = {"call_len": 4, "call_offset": 0, "comm": "curl", "conn_id": 9, "daddr": "192.0.2.2", "data": "cGluZw==",
           "direction": "egress", "dport": 80, "family": "ipv4", "flags": [], "len": 4, "offset": 0, "pid": 1,
           "saddr": "192.0.2.1", "sport": 40000, "tid": 1, "ts_ns": 1000, "type": "chunk"}
    rec.update(kw)
    return (_json.dumps(rec, sort_keys=True) + "\n").encode()


def test_hostile_files_are_read_in_bounded_memory_and_stack(tmp_path, capsys):
    """What crashed nettap read: 5,000 truncated calls in a row (a recursion
    per call), 100,000 nested brackets, a line past the limit (read whole
    before), a port of 70,000 (dpkt refused the pcap), offsets of 2^40, and
    a task name with terminal escapes (printed raw)."""
    f = tmp_path / "hostile.jsonl"
    with open(f, "wb") as out:
        out.write(_chunk(comm="evil\x1b]0;owned\x07\x1b[2J"))
        for i in range(5000):                        # empty truncated calls, back to back
            out.write(_chunk(call_offset=4 + 10 * i, call_len=10, offset=4 + 10 * i, len=0, data="", ts_ns=2000 + i))
        out.write(b"[" * 100_000 + b"\n")
        out.write(b'{"type": "chunk", "comm": "' + b"x" * (streams.MAX_LINE + 10) + b'"}\n')
        out.write(_chunk(conn_id=10, sport=70000))
        out.write(_chunk(conn_id=11, offset=1 << 40, call_offset=1 << 40, sport=40001))
    rc, out_, err = run(capsys, str(f))
    assert rc == 0, err
    assert "Traceback" not in err and "\x1b" not in out_ and "\\x1b]0;owned\\x07" in out_
    assert err.startswith("nettap read: skipped 3 line(s): ")
    for reason in ("1 not JSON", f"1 longer than {streams.MAX_LINE} bytes",
                   "1 chunk record(s) with a missing or bad sport"):
        assert reason in err, err
    rows = out_.splitlines()
    assert rows[1].split()[7:9] == ["5000", "calls,"]          # truncated calls counted, none recursed
    rc, out_, err = run(capsys, str(f), "--conn", "9")
    assert rc == 0 and "evil\\x1b]0;owned\\x07\\x1b[2J" in out_.splitlines()[0]
    rc, _, err = run(capsys, str(f), "--pcap", str(tmp_path / "h.pcap"))
    assert rc == 0 and "wrote" in err.splitlines()[-1], err


def test_a_fifo_to_read_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.jsonl")
    rc, out, err = run(capsys, str(tmp_path / "fifo.jsonl"))
    assert rc == 1 and err.splitlines()[0] == f"nettap read: cannot read {tmp_path / 'fifo.jsonl'}: not a regular file"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink"])
def test_pcap_output_never_follows_a_link_or_waits_on_a_fifo(tmp_path, capsys, kind):
    """--pcap OUT as root: a link another user planted at OUT (a sticky
    world-writable directory, fs.protected_symlinks 0) must not make nettap
    overwrite its target; a FIFO must not hang it."""
    victim, out = tmp_path / "victim", tmp_path / "out.pcap"
    victim.write_bytes(b"keep me")
    if kind == "symlink":
        out.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, out)
    else:
        os.mkfifo(out)
    rc, _, err = run(capsys, *NEWEST_FIRST, "--pcap", str(out))
    why = {"symlink": "it is a symbolic link: nettap does not follow links for what it writes",
           "fifo": "not a regular file",
           "hardlink": "it has 2 hard links: it may be another file under a second name"}[kind]
    assert rc == 1 and err.splitlines()[-1] == f"nettap read: cannot write {out}: {why}"
    assert victim.read_bytes() == b"keep me"


def test_help_names_the_command():
    rc, out, _ = nettap("--help", cwd=ROOT)
    assert rc == 0 and "nettap read FILE..." in out and "--pcap OUT" in out
    rc, out, _ = nettap("read", "--help", cwd=ROOT)
    assert rc == 0 and out.startswith("usage: nettap read [-h] [--conn ID]")


def test_capture_gaps_from_the_runs_start_and_stop_lines():
    marks = [("start", "T1", 10), ("stop", "T2", 10), ("start", "T3", 11), ("start", "T4", 12),
             ("stop", "T5", 12), ("start", "T6", 13)]
    assert missed.capture_gaps(marks) == [
        "nothing was captured from the stop at T2 until the start at T3",
        "the run started T3 (pid 11) has no stop line: it ended uncleanly; nothing was captured from its "
        "last record until T4",
        "nothing was captured from the stop at T5 until the start at T6",
        "the run started T6 (pid 13) has no stop line yet (still running, or it ended uncleanly)"]
    assert missed.capture_gaps([("start", "T1", 10)]) == []            # one run going on: no gap
    assert missed.capture_gaps([]) == []


RECORD_FIX = Path(__file__).resolve().parent / "fixtures" / "records"


def test_every_kind_nettap_writes_is_a_known_type(tmp_path, capsys):
    """Every record kind nettap's writer puts in a file (the record fixtures,
    one per kind: dlopen lines included, issue 45) is a type nettap read knows."""
    from exporter.capture.records import RING_KINDS
    kinds = [k for ks in RING_KINDS.values() for k in ks]
    lines = [(RECORD_FIX / f"{k}.jsonl").read_bytes().splitlines(keepends=True)[0] for k in kinds]
    f = tmp_path / "all.jsonl"
    f.write_bytes(b"".join(lines))
    rc, out, err = run(capsys, str(f))
    assert "unknown type" not in err, err
    assert rc == 0 and ", 1 dns (--dns lists them), 1 dlopen\n" in out, out


def test_dns_records_whose_data_is_not_base64_are_counted_never_a_traceback(tmp_path, capsys):
    """nettap read --dns on a dns record whose data is not base64 (issue 45):
    skipped and counted as file reading counts a bad chunk; the good ones listed."""
    good = (RECORD_FIX / "dns.jsonl").read_bytes().splitlines(keepends=True)[0]
    f = tmp_path / "dns.jsonl"
    f.write_bytes(good + good.replace(b'"data":"R0VUIC8="', b'"data":"!!not base64"')
                  + good.replace(b'"data":"R0VUIC8="', b'"data":"R0VUIC8"'))
    rc, out, err = run(capsys, "--dns", str(f))
    assert rc == 0 and "Traceback" not in err
    assert err == (f"nettap read: skipped 2 line(s): 2 dns record(s) whose data is not base64 "
                   f"(first: {f}:2)\n")
    assert out.splitlines()[-1].startswith("0 DNS queries")


def _fuzzed_files(tmp_path, rng, n):
    """n capture files of fixture records with fields set to hostile values."""
    recs = []
    for p in sorted((RECORD_FIX.glob("*.jsonl"))) + [FIX / "capture.jsonl.1", FIX / "capture.jsonl.2"]:
        for raw in p.read_bytes().splitlines():
            try:
                recs.append(json.loads(raw))
            except ValueError:
                pass
    values = [0, -1, 2**64 - 1, 2**64, 10**30, "", "x", "ipv6", "egress", "tcp", [], ["read_failed"], {}, None,
              True, 1.5, "AAAA"]
    for i in range(n):
        lines = []
        for _ in range(rng.randrange(1, 10)):
            r = dict(rng.choice(recs))
            for _ in range(rng.randrange(3)):
                k = rng.choice(list(r))
                r[k] = rng.choice(values + [r[k]])
            lines.append(json.dumps(r))
        f = tmp_path / f"f{i}.jsonl"
        f.write_text("\n".join(lines) + "\n")
        yield f


def test_hostile_field_values_never_a_traceback_in_any_mode(tmp_path, capsys):
    """Fixture records with a field set to another type or an out-of-range
    value, read in every mode (issue 45: a conn_id that is a JSON object
    raised in --conn's filter; a ts_ns past 2^32 s raised in the pcap
    writer): skipped and counted, or said, never an exception."""
    import random
    chunk = json.loads((FIX / "capture.jsonl.2").read_bytes().splitlines()[0])
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(json.dumps({**chunk, "conn_id": {}}) + "\n" + json.dumps({**chunk, "ts_ns": 2**64 - 1}) + "\n")
    rc, out, err = run(capsys, "--pcap", str(tmp_path / "o.pcap"), "--conn", "1", str(fixed))
    assert rc == 0 and "5 packet(s) timed past what a pcap holds (2^32 s): written at its last second" in err
    assert "skipped 1 line(s): 1 chunk record(s) with a missing or bad conn_id" in err
    rng = random.Random(45)
    for f in _fuzzed_files(tmp_path, rng, 150):
        for args in (["--dns"], [], ["--conn", "1", "--conn", "2"], ["--pcap", str(tmp_path / "o.pcap"), "--conn", "1"],
                     ["--conn", "2", "--hex"]):
            run(capsys, *args, str(f))


def test_the_readers_schemas_are_the_record_table():
    """The reader checks every field of a record kind as bpf/tcp.h's table
    says (exporter/kernel/tcp_h.py, generated): each kind's plain fixture
    line passes, the same line without a field or with a number its C type
    cannot hold does not."""
    for kind in streams.tcp_h.RECORDS:
        rec = json.loads((RECORD_FIX / f"{kind}.jsonl").read_bytes().splitlines()[0])
        assert set(streams.SCHEMAS[kind]) == set(rec) - {"type"}, kind
        assert streams._check(dict(rec), "x", streams.Problems()) is not None, kind
    state = json.loads((RECORD_FIX / "state.jsonl").read_bytes().splitlines()[0])
    for bad, reason in (({"sport": 1 << 16}, "bad sport"), ({"netns": 1 << 32}, "bad netns"),
                        ({"netns": None}, "bad netns"), ({"family": 2}, "bad family")):
        problems = streams.Problems()
        assert streams._check({**state, **bad}, "x", problems) is None
        assert list(problems.counts) == [f"state record(s) with a missing or {reason}"]
