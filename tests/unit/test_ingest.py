"""nettap ingest without an engine: its settings, how a region becomes
messages, the checkpoint, and the forwarder over files written by the
capture's own sink (acknowledgements given by hand)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from exporter import config
from exporter.capture.sinks import JsonlFileSink
from exporter.config import ConfigError
from exporter.ingest import batches, checkpoint, settings
from exporter.ingest.checkpoint import Checkpoint, CheckpointError
from exporter.ingest.files import FileId, Files, count_lines, fingerprint
from exporter.ingest.forwarder import Forwarder
from exporter.ingest.publisher import _covers, classify
from exporter.ingest.stats import Stats

FIXTURES = Path(__file__).parent / "fixtures" / "records"       # the writer's lines of every kind


def parse(ingest, **output):
    out = {"type": "jsonl", "path": "/var/lib/nettap/capture.jsonl", **output}
    cfg = config.parse({"output": out, "ingest": ingest})
    return settings.parse(cfg.ingest, cfg.output)


def test_defaults_and_secrets_kept_out_of_repr(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    s = parse({"servers": ["nats://a:4222", "tls://b:4222"], "node": "node/1", "user": "u", "password_file": str(pw)})
    assert s.servers == ("nats://a:4222", "tls://b:4222") and s.node == "node_1"
    assert s.password == "s3cret" and "s3cret" not in repr(s)
    assert s.checkpoint == "/var/lib/nettap/.capture.jsonl.ingest"
    assert s.stream.name == "NETTAP" and s.stream.duplicate_window == 1200 and s.ack_timeout == 5
    assert s.auth_options() == {"user": "u", "password": "s3cret"}


@pytest.mark.parametrize("ingest, output, says", [
    ({"servers": ["http://a"]}, {}, "ingest.servers[0]: must be a URL like nats://host:4222"),
    ({"user": "u", "token": "t", "password": "p"}, {}, "give one way to authenticate"),
    ({"user": "u"}, {}, "ingest.user: needs password"),
    ({"password": "p"}, {}, "ingest.password: needs user"),
    ({"subject": "nettap.{node}"}, {}, "must contain {node} and {kind}"),
    ({"subject": "nettap.{node}.{kind}.{x}"}, {}, "only {node} and {kind}"),
    ({"stream": {"duplicate_window": "2h", "max_age": "1h"}}, {}, "longer than max_age"),
    ({"stream": {"name": "a.b"}}, {}, "ingest.stream.name"),
    ({"ack_timeout": "soon"}, {}, "ingest.ack_timeout: must be a duration"),
    ({"bogus": 1}, {}, "ingest.bogus: unknown key"),
    ({}, {"backups": 0}, "output.backups must be at least 1"),
    ({"nkey_file": "/nonexistent"}, {}, "ingest.nkey_file: /nonexistent is not a file"),
    ({"tls": {"ca_file": "/etc/hostname"}}, {}, "ingest.tls: cannot use the certificate files"),
])
def test_a_bad_section_is_refused_naming_the_key(ingest, output, says):
    with pytest.raises(ConfigError, match=None) as e:
        parse(ingest, **output)
    assert says in str(e.value)


def test_the_capture_keeps_the_section_unread_and_ingest_needs_one():
    assert config.parse({"ingest": {"anything": 1}}).ingest == {"anything": 1}
    with pytest.raises(ConfigError, match="output.type must be jsonl"):
        settings.parse({}, config.parse({}).output)
    with pytest.raises(ConfigError, match="ingest: missing"):
        settings.parse(None, config.parse({}).output)


def test_a_region_splits_by_kind_in_file_order_under_ids_naming_both_ends():
    fid = FileId(1, 2, "ab")
    data = b'{"i":0,"type":"chunk"}\n{"i":1,"type":"eof"}\nnot json\n{"i":2,"type":"chunk"}\n{"i":3}'
    r = batches.region(fid, 100, data, "n1", "nettap.{node}.{kind}")
    got = {m.kind: (m.subject, m.payload, m.records, m.msg_id) for m in r.messages}
    assert got["chunk"] == ("nettap.n1.chunk", b'{"i":0,"type":"chunk"}\n{"i":2,"type":"chunk"}\n', 2,
                            f"n1:1:2:ab:100-{100 + len(data)}:chunk")
    assert got["invalid"][1] == b'not json\n{"i":3}\n' and r.records == 5 and r.pending == 3
    again = batches.region(fid, 100, data, "n1", "nettap.{node}.{kind}")
    assert [(m.msg_id, m.payload) for m in again.messages] == [(m.msg_id, m.payload) for m in r.messages]


def test_an_owner_message_names_its_pods_in_a_header():
    """Nettap-Pods on an owner message: the pods its lines name (docs/kubernetes.md), distinct and
    sorted; none on other kinds or where no line names one; bounded, and within header_room."""
    fid = FileId(1, 2, "ab")

    def owner(i, ns="", pod="", c=""):
        keys = (f'"container":"{c}",' if c else "") + (f'"namespace":"{ns}",' if ns else "") + \
            (f'"pod":"{pod}","pod_uid":"u{i}",' if pod else "")
        return f'{{"comm":"a","conn_id":{i},{keys}"type":"owner"}}\n'.encode()
    data = (owner(1, "shop", "checkout-2", "api") + b'{"conn_id":1,"type":"chunk"}\n' + owner(2, "shop", "cart-1")
            + owner(3) + owner(4, "shop", "checkout-2", "api") + owner(5, "a b", "x y", "z"))
    r = batches.region(fid, 0, data, "n1", "nettap.{node}.{kind}")
    got = {m.kind: m.headers for m in r.messages}
    assert got["owner"]["Nettap-Pods"] == "a_b/x_y/z,shop/cart-1,shop/checkout-2/api"
    assert "Nettap-Pods" not in got["chunk"]
    assert "Nettap-Pods" not in batches.region(fid, 0, owner(3), "n1", "x").messages[0].headers
    many = b"".join(owner(i, "ns", f"pod-{i:04}", "c") for i in range(200))
    header = batches.pods(many)
    assert len(header) <= batches.PODS_MAX and header.endswith(",...") and header.startswith("ns/pod-0000/c,")
    m = batches.region(fid, 0, many, "n1", "x").messages[0]
    assert batches.header_bytes(m.headers) <= batches.header_room("n1", fid, "owner")
    parts, lost = batches.parts(m, many, "n1", 4096)
    assert lost == 0 and len(parts) > 1 and all(p.headers["Nettap-Pods"] == batches.pods(p.payload) for p in parts)


def test_stream_subjects_cover():
    assert _covers("nettap.*.*", "nettap.*.*") and _covers("nettap.>", "nettap.*.*")
    assert not _covers("nettap.n1.*", "nettap.*.*") and not _covers("other.>", "nettap.*.*")
    assert classify(Exception("nats: 'Authorization Violation'")) == "auth"
    assert classify(ConnectionRefusedError(111, "Connect call failed")) == "refused"


def test_checkpoint_round_trip_and_garbage(tmp_path):
    p = str(tmp_path / "cp")
    assert checkpoint.load(p) is None
    cp = Checkpoint(FileId(5, 6, "0123456789abcdef"), 10, (20, 35))
    checkpoint.save(p, cp)
    assert checkpoint.load(p) == cp and oct(os.stat(p).st_mode & 0o777) == "0o600"
    for bad in (b"{", b'{"version":1}', b'{"version":1,"file":null,"offset":9,"cuts":[5]}', b"[]"):
        open(p, "wb").write(bad)
        with pytest.raises(CheckpointError, match="not a nettap ingest checkpoint"):
            checkpoint.load(p)


def test_a_file_is_known_by_its_first_line_too(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b'{"a"')
    fd = os.open(p, os.O_RDONLY)
    try:
        assert fingerprint(fd) is None                   # its first line not complete yet
        p.write_bytes(b'{"a":1}\n{"b"')
        assert fingerprint(fd) and count_lines(fd, 0) == 2 and count_lines(fd, 8) == 1
    finally:
        os.close(fd)


def lines(start, n):
    return [json.dumps({"i": i, "type": "chunk" if i % 3 else "state"}) for i in range(start, start + n)]


def forwarded(fw, acked_all=True):
    """Take what the forwarder offers; acknowledge it all; the records, in order."""
    got = []
    while True:
        regions = fw.take()
        if not regions:
            return got
        for r in regions:
            for m in r.messages:
                got += [json.loads(x)["i"] for x in m.payload.splitlines()]
                if acked_all:
                    fw.acked(m, False)


def make(tmp_path, max_bytes=4096, backups=3, stats=None):
    out = str(tmp_path / "capture.jsonl")
    sink = JsonlFileSink(out, max_bytes, backups)
    sink.open()
    fw = Forwarder(Files(out, backups), out + ".checkpoint", "n1", "nettap.{node}.{kind}", stats or Stats(),
                   batch_bytes=1024, max_in_flight=8192)
    return sink, fw


def test_the_forwarder_follows_rotation_in_order_and_resumes_where_acknowledged(tmp_path):
    sink, fw = make(tmp_path)
    fw.start()
    sink.write(lines(0, 150))                   # several files: rotation keeps path and 3 backups
    fw.tick()
    got = forwarded(fw)
    sink.write(lines(150, 50))
    fw.tick()
    got += forwarded(fw)
    assert sorted(got) == list(range(200)) and fw.stats.records_acked == 200
    fw.save_if_moved()
    fw.close()
    sink.write(lines(200, 10))
    _, fw2 = make(tmp_path)
    fw2.start()
    fw2.tick()
    assert sorted(forwarded(fw2)) == list(range(200, 210))    # only what was not acknowledged


def test_after_a_crash_the_journalled_regions_are_sent_again_byte_for_byte(tmp_path):
    sink, fw = make(tmp_path, max_bytes=1 << 20)
    fw.start()
    sink.write(lines(0, 100))
    fw.tick()
    first = [(m.msg_id, m.payload) for r in fw.take() for m in r.messages]   # sent, never acknowledged
    sink.write(lines(100, 100))                 # more written before the restart
    _, fw2 = make(tmp_path, max_bytes=1 << 20)
    fw2.start()                                 # no close(): a kill -9
    again = [(m.msg_id, m.payload) for r in fw2.take() for m in r.messages]
    assert again[:len(first)] == first


def test_a_file_rotated_away_unforwarded_is_counted_lost_by_its_lines(tmp_path):
    sink, fw = make(tmp_path, max_bytes=2048, backups=1)
    fw.start()
    sink.write(lines(0, 10))
    fw.tick()
    taken = fw.take()                           # in flight, never acknowledged: an engine away
    for i in range(10, 200, 10):
        sink.write(lines(i, 10))
        fw.tick()
    kept = set()
    for name in ("capture.jsonl", "capture.jsonl.1"):
        kept |= {json.loads(x)["i"] for x in (tmp_path / name).read_bytes().splitlines()}
    sent = {json.loads(x)["i"] for r in taken for m in r.messages for x in m.payload.splitlines()}
    assert fw.stats.lost["rotated"] == len(set(range(200)) - kept - sent) > 0


def test_a_line_no_message_can_hold_is_skipped_and_counted(tmp_path):
    stats = Stats()
    sink, fw = make(tmp_path, max_bytes=1 << 20, stats=stats)
    fw.max_message = 5000
    fw.start()
    sink.write(lines(0, 2) + [json.dumps({"i": 2, "type": "chunk", "data": "x" * 6000})] + lines(3, 2))
    fw.tick()
    assert forwarded(fw) == [0, 1, 3, 4] and stats.lost["too_large"] == 1


def test_regions_are_no_longer_than_the_server_allows_a_message(tmp_path):
    sink, fw = make(tmp_path, max_bytes=1 << 20)
    fw.max_message = 1000                       # a server whose max_payload is below a batch: headers included
    fw.start()
    sink.write(lines(0, 40))
    fw.tick()
    regions = fw.take()
    assert len(regions) > 1 and all(len(m.payload) + batches.header_bytes(m.headers) <= 1000
                                    for r in regions for m in r.messages)


def test_the_compiled_split_gives_what_the_line_by_line_split_gives():
    """batches.split takes the compiled kind_split where every line has a kind,
    and goes line by line otherwise: the same payloads either way, for the writer's own
    lines of every kind (an owner's "via" comes after its "type"), interleaved a few at a
    time as the obs_events ring has them, and the start and stop lines."""
    import random
    from exporter.ingest._split import SPLIT_KINDS_MAX, kind_split
    from exporter.capture.sinks import mark_line
    real = {p.stem: p.read_bytes().splitlines(True) for p in FIXTURES.glob("*.jsonl")}
    assert "owner" in real and "chunk" in real
    real["start"], real["stop"] = [mark_line("start")], [mark_line("stop")]
    rnd = random.Random(7)
    kinds = sorted(real)
    for _ in range(200):
        data = b"".join(line for _ in range(rnd.randrange(1, 40))
                        for line in rnd.choices(real[rnd.choice(kinds)], k=rnd.randrange(1, 6)))
        assert kind_split(data) is not None
        fast = batches.split(memoryview(data))
        assert {k: (bytes(p), n) for k, (p, n) in fast.items()} == batches._split_lines(data)
        assert list(fast) == list(batches._split_lines(data))          # kinds in order of appearance
    for k, lines in real.items():
        assert kind_split(b"".join(lines)) == [(k.encode(), None, len(lines))]   # one kind: its own payload
    assert kind_split(b'{"type":"chunk"}\n{"type":"chunk"}') is None        # a line without its newline
    assert kind_split(b'{"a":"x\\"type\\":\\"eof"}\n') is None               # inside a string: not a key
    assert kind_split(b'{"a":1}\n') is None                                  # no kind: line by line
    assert batches.split(b'{"a":1}\n{"type":"eof"}\n') == {batches.INVALID: (b'{"a":1}\n', 1),
                                                           "eof": (b'{"type":"eof"}\n', 1)}
    assert kind_split(b'{"i":1,"type":"eof"}\n{"type":"chunk"}\n{"i":2,"type":"eof"}\n') == \
        [(b"eof", b'{"i":1,"type":"eof"}\n{"i":2,"type":"eof"}\n', 2), (b"chunk", b'{"type":"chunk"}\n', 1)]
    many = b"".join(b'{"type":"k%d"}\n' % i for i in range(SPLIT_KINDS_MAX + 1))    # more kinds than it gathers
    assert kind_split(many) is None and len(batches.split(many)) == SPLIT_KINDS_MAX + 1


def test_a_deeply_nested_checkpoint_is_refused_not_raised(tmp_path):
    p = tmp_path / "cp"
    p.write_bytes(b"[" * 100_000 + b"]" * 100_000)          # json's RecursionError
    with pytest.raises(CheckpointError, match="not a nettap ingest checkpoint"):
        checkpoint.load(str(p))


def test_a_fifo_checkpoint_is_refused_not_waited_on(tmp_path):
    """open() of a FIFO waits for a writer for ever: refused at once, and
    replaced by a file at the next save."""
    import threading
    p = tmp_path / "cp"
    os.mkfifo(p)
    said = []
    t = threading.Thread(target=lambda: said.append(_load_or_error(str(p))), daemon=True)
    t.start()
    t.join(3)
    if t.is_alive():                            # unblock the open() before failing
        fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(3)
        pytest.fail("loading a FIFO checkpoint waited for a writer")
    assert "not a regular file" in said[0]
    checkpoint.save(str(p), Checkpoint(None, 0, ()))       # replaced by a file
    assert checkpoint.load(str(p)) == Checkpoint(None, 0, ())


def _load_or_error(path):
    try:
        return repr(checkpoint.load(path))
    except CheckpointError as e:
        return str(e)


@pytest.mark.parametrize("lie", ["past_end", "mid_line", "cut_mid_line", "cut_past_end"])
def test_a_checkpoint_that_lies_about_the_file_starts_over_with_a_warning(tmp_path, caplog, lie):
    """Offsets past the end sent nothing; offsets mid-line sent fragments:
    checked against the file, a lie starts over from the files' start."""
    sink, fw = make(tmp_path, max_bytes=1 << 20)
    fw.start()
    sink.write(lines(0, 30))
    fw.tick()
    assert sorted(forwarded(fw)) == list(range(30))
    fw.close()
    cp = checkpoint.load(fw.path)
    size = os.path.getsize(tmp_path / "capture.jsonl")
    first = len((tmp_path / "capture.jsonl").read_bytes().split(b"\n", 2)[0]) + 1   # the start line's end
    bad = {"past_end": cp._replace(offset=size + 1000, cuts=()),
           "mid_line": cp._replace(offset=first + 5, cuts=()),
           "cut_mid_line": cp._replace(offset=first, cuts=(first + 7,)),
           "cut_past_end": cp._replace(offset=first, cuts=(size + 50,))}[lie]
    checkpoint.save(fw.path, bad)
    _, fw2 = make(tmp_path, max_bytes=1 << 20)
    with caplog.at_level("WARNING", logger="nettap.ingest"):
        fw2.start()
    fw2.tick()
    again = forwarded(fw2)
    assert sorted(again) == list(range(30)), again      # every line, whole: from the start
    assert "checkpoint" in caplog.text and "starting over" in caplog.text


def test_nothing_is_handed_out_before_its_region_is_in_the_checkpoint(tmp_path, caplog):
    """A checkpoint that cannot be written (here its directory is missing):
    no region leaves, the failure is logged once, and once it can be written
    again everything goes, each line once."""
    out = str(tmp_path / "capture.jsonl")
    sink = JsonlFileSink(out, 1 << 20, 3)
    sink.open()
    cpdir = tmp_path / "cp"
    stats = Stats()
    fw = Forwarder(Files(out, 3), str(cpdir / "checkpoint"), "n1", "nettap.{node}.{kind}", stats,
                   batch_bytes=1024, max_in_flight=8192)
    with caplog.at_level("ERROR", logger="nettap.ingest"):
        fw.start()
        for i in range(5):
            sink.write(lines(10 * i, 10))
            fw.tick()
            assert fw.take() == []
        fw.save_if_moved()
    assert stats.checkpoint_errors >= 5
    assert caplog.text.count("cannot write") == 1
    cpdir.mkdir()
    got = forwarded(fw)
    assert sorted(got) == list(range(50))
    fw.save_if_moved()
    assert checkpoint.load(str(cpdir / "checkpoint")).offset == os.path.getsize(out)


def test_a_message_too_large_for_the_engine_is_sent_in_parts_of_its_own_lines(tmp_path):
    """Parts hold the message's lines, each once, in order, each part within
    the limit; a part split again (the limit lowered again) holds only its
    own lines; the same limit gives the same parts under the same ids."""
    sink, fw = make(tmp_path, max_bytes=1 << 20)
    fw.batch_bytes = 8192
    fw.start()
    sink.write(lines(0, 200))
    fw.tick()
    r = fw.take()[0]
    m = max(r.messages, key=lambda x: len(x.payload))
    whole = m.payload.splitlines()
    parts = fw.split(m, 2000)
    again = batches.parts(m, os.pread(fw.cur.fd, r.end - r.start, r.start), "n1", 2000 - batches.header_room(
        "n1", r.fid, m.kind))[0]
    assert [p.msg_id for p in parts] == [p.msg_id for p in again] and len(parts) > 2
    assert all(len(p.payload) + batches.header_bytes(p.headers) <= 2000 for p in parts)
    assert b"".join(p.payload for p in parts).splitlines() == whole
    assert all(p.headers["Nettap-Region"] == f"{r.start}-{r.end}" for p in parts)
    assert parts[0].span[0] == r.start and parts[-1].span[1] == r.end
    second = parts[1].payload
    inner = fw.split(parts[1], 900)             # its own lines only, not the region's of its kind
    assert b"".join(p.payload for p in inner) == second and len(inner) > 1
    assert all(parts[1].span[0] <= p.span[0] < p.span[1] <= parts[1].span[1] for p in inner)
    assert r.pending == len(r.messages)         # the split ones replaced by their parts
