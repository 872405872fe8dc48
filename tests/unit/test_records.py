"""Golden contract of the kind records: fixtures/records/*.bin (written by
make_fixture.py) decode to fixtures/records/*.jsonl byte for byte, in process
and through ``nettap --decode``.

The *.jsonl files were generated once from the decoder, then read by hand;
test_golden_independent re-derives what it can from the generator's record
specs without using exporter.capture.records' formatting."""
from __future__ import annotations

import base64
import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.capture import records as R
from tests import oracles
from tests.oracles import walk

from .record_fixtures import FIX, KINDS, ROOT, mf, ring_of

# Written out from include/net/tcp_states.h and bpf/tcp.h, not taken from exporter.capture.records.
TCP_STATE_NAMES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
                   6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
                   11: "CLOSING", 12: "NEW_SYN_RECV", 13: "BOUND_INACTIVE"}
DIRECTION_NAMES = {0: "egress", 1: "ingress"}
FLAG_NAMES = {0: [], 1: ["read_failed"], 2: ["no_conn"], 3: ["read_failed", "no_conn"]}
FAMILY_NAMES = {2: "ipv4", 10: "ipv6"}
NO_COMM = {"state", "reset", "error", "destroy",     # kinds without a task name: recorded in softirq too
           "retransmit", "synack_retransmit", "timer", "probe", "segment", "timewait", "request"}
VIA_NAMES = {1: "connect", 2: "first_call", 3: "accept"}
CAUSE_NAMES = {1: "rto", 2: "tlp", 3: "fast", 4: "synack"}
TIMER_NAMES = {1: "retransmit", 2: "keepalive"}
EVENT_NAMES = {0: "none", 1: "rto", 3: "probe0", 5: "loss_probe", 6: "reo_timeout"}
WAKEUP_NAMES = {1: "window", 2: "keepalive"}
# Written out for the errors a TCP socket reports; the rest from Python's table of Linux's numbers.
ERRNO_NAMES = {**errno.errorcode, 32: "EPIPE", 104: "ECONNRESET", 110: "ETIMEDOUT", 111: "ECONNREFUSED",
               113: "EHOSTUNREACH"}
CODE_NAMES = {1: "read_user_failed", 2: "conn_table_full", 3: "inflight_full", 4: "iov_truncated",
              5: "payload_unreadable"}
PROBE_NAMES = {0: "tcp_sendmsg", 1: "tcp_recvmsg", 2: "ssl_write", 3: "ssl_read", 4: "ssl_handshake", 5: "dns",
               6: "go_tls_write", 7: "go_tls_read"}


def _bin(kind: str) -> Path:
    return FIX / f"{mf.FILES[kind]}.bin"


def _golden(kind: str) -> bytes:
    return (FIX / f"{mf.FILES[kind]}.jsonl").read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_bin_matches_generator(kind):
    assert _bin(kind).read_bytes() == mf.build(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_walk_counts(kind):
    buf = _bin(kind).read_bytes()
    recs, bad, pos = walk(buf, R.DTYPES[kind])
    assert (len(recs), bad, pos) == (len(mf.good_records(kind)), 2, len(buf))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_golden(kind):
    recs, _, _ = walk(_bin(kind).read_bytes(), R.DTYPES[kind])
    out = "".join(line + "\n" for line in oracles.lines(kind, recs)).encode("utf-8")
    assert out == _golden(kind)


def _expected_addr(spec: dict, key: str):
    v = spec.get(key)
    if not isinstance(v, str):
        return None                      # raw bytes (unknown family): checked by the golden only
    fam = socket.AF_INET6 if spec.get("family") == socket.AF_INET6 else socket.AF_INET
    return socket.inet_ntop(fam, socket.inet_pton(fam, v))   # RFC 5952 form (::ffff:1.2.3.4 mixed)


@pytest.mark.parametrize("kind", KINDS)
def test_golden_independent(kind):
    lines = _golden(kind).decode("utf-8").split("\n")
    assert lines.pop() == ""                                    # ends in exactly one newline
    specs = mf.good_records(kind)
    assert len(lines) == len(specs)
    for line, spec in zip(lines, specs):
        obj = json.loads(line)
        assert list(obj) == sorted(obj), line
        assert obj["type"] == kind
        for k, v in obj.items():                                # every integer is the record's value
            if isinstance(v, int):
                assert v == spec.get(k, 0), (k, line)
        if kind not in NO_COMM:
            assert obj["comm"] == spec.get("comm", b"").split(b"\0", 1)[0].decode("utf-8", "replace")
        if kind == "log":
            if spec.get("code", 0) in CODE_NAMES:
                assert obj["code"] == CODE_NAMES[spec["code"]]
            else:
                assert obj["code"] == str(spec.get("code", 0))
            assert obj["probe"] == PROBE_NAMES.get(spec.get("probe", 0), str(spec.get("probe", 0)))
            continue
        if kind == "dlopen":                                    # a file, not a socket
            assert obj["name"] == spec.get("name", b"").split(b"\0", 1)[0].decode("utf-8", "replace")
            continue
        assert obj["family"] == FAMILY_NAMES.get(spec.get("family", 0), str(spec.get("family", 0)))
        for key in ("saddr", "daddr"):
            want = _expected_addr(spec, key)
            if want is not None:
                assert obj[key] == want
        if kind in ("chunk", "reset"):
            if spec.get("direction", 0) in DIRECTION_NAMES:
                assert obj["direction"] == DIRECTION_NAMES[spec.get("direction", 0)]
            else:
                assert obj["direction"] == str(spec.get("direction", 0))
        if kind in ("reset", "error", "destroy", "retransmit", "timer", "probe"):
            assert obj["state"] == TCP_STATE_NAMES.get(spec.get("state", 0), str(spec.get("state", 0)))
        if kind == "retransmit":
            assert obj["cause"] == CAUSE_NAMES.get(spec.get("cause", 0), str(spec.get("cause", 0)))
        if kind == "timer":
            assert obj["timer"] == TIMER_NAMES.get(spec.get("timer", 0), str(spec.get("timer", 0)))
            assert obj["event"] == EVENT_NAMES.get(spec.get("event", 0), str(spec.get("event", 0)))
        if kind == "probe":
            assert obj["probe"] == WAKEUP_NAMES.get(spec.get("probe", 0), str(spec.get("probe", 0)))
        if kind == "error":
            name = spec.get("errno_name", 0)
            assert obj["errno_name"] == ERRNO_NAMES.get(name, str(name))
        elif kind == "owner":
            assert obj["via"] == VIA_NAMES.get(spec.get("via", 0), str(spec.get("via", 0)))
        elif kind == "chunk":
            n = spec.get("len", 0)
            payload = spec.get("data", b"").ljust(R.CHUNK_DATA, b"\0")[:min(n, R.CHUNK_DATA)]
            assert base64.b64decode(obj["data"], validate=True) == payload
            if spec.get("flags", 0) in FLAG_NAMES:
                assert obj["flags"] == FLAG_NAMES[spec.get("flags", 0)]
        elif kind in ("state", "eof"):
            for key in ("oldstate", "newstate") if kind == "state" else ("oldstate",):
                st = spec.get(key, 0)
                assert obj[key] == TCP_STATE_NAMES.get(st, str(st))


def test_golden_contains_every_comm_case():
    # The golden lines of the comm cases, as read and checked by hand.
    want = ["curl", 'a"b\\c\x01d\x1fe\tf\ng\x7f', "h\u00e9llo\u2192\U0001F600", "a\ufffdb",
            "abcdefghijklmn\ufffd", "a\ufffdb", "ab\ufffd", "a\ufffd\ufffdb", "a\ufffd\ufffd\ufffdb",
            "a\ufffdb", "ab", "0123456789abcdef", "0123456789ab\U0001F600"]
    for kind in KINDS:
        if kind in NO_COMM:                                       # no task name in its records
            continue
        comms = [json.loads(x)["comm"] for x in _golden(kind).decode().splitlines()]
        at = comms.index(want[1]) - 1                              # the cases, in a row
        assert comms[at:at + len(want)] == want


def test_golden_escapes_are_json_escapes():
    lines = [x for x in _golden("log").decode().splitlines() if '"comm":"a\\"b' in x]
    assert len(lines) == 1 and '"comm":"a\\"b\\\\c\\u0001d\\u001fe\\tf\\ng\x7f"' in lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_cli_decode(kind):
    path = str(_bin(kind))
    # PYTHONIOENCODING pins stdout to UTF-8: the CLI writes through the
    # locale's text stream (see the report on exporter/commands/cli.py).
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run([sys.executable, "-m", "exporter", "--decode", path, "--ring", ring_of(kind)],
                       cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert p.returncode == 1                     # the fixture's 2 bad records (test_decode.py)
    assert p.stdout == _golden(kind)
    assert p.stderr.endswith(b" 2 bad record(s) or stretch(es) of garbage skipped (in %d bytes read)\n"
                             % len(_bin(kind).read_bytes()))


def test_cli_decode_unknown_ring():
    p = subprocess.run([sys.executable, "-m", "exporter", "--decode", str(_bin("log")), "--ring", "nope"],
                       cwd=ROOT, capture_output=True, timeout=60)
    assert (p.returncode, p.stdout) == (2, b"")
    assert p.stderr == (b"nettap: --ring must be one of capture_chunks, capture_eof, logs, obs_events, dlopen, "
                        b"segments, dns\n")
