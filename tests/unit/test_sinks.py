"""exporter.sinks: size rotation keeps whole lines and N backups; a failed
write is counted (errors, lost) and never raises."""
from __future__ import annotations

import logging
import os
import resource
from pathlib import Path


from exporter import sinks
from exporter.config import Output
from exporter.sinks import JsonlFileSink, Sink, StdoutSink


def line(i: int) -> str:
    return f'{{"n":{i:03d}}}'            # 9 characters: 10 bytes with its newline


def read_lines(p: Path):
    data = p.read_bytes()
    assert data.endswith(b"\n")          # no line is split at a file's end
    return [int(x[5:8]) for x in data.decode().splitlines()]


def files(d: Path):
    return sorted(p.name for p in d.iterdir())


def test_rotation_keeps_n_backups(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=25, backups=2)
    for i in range(10):
        s.write([line(i)])
    s.close()
    # 25 bytes hold two 10-byte lines: the third starts a new file
    assert files(tmp_path) == ["out.jsonl", "out.jsonl.1", "out.jsonl.2"]
    assert read_lines(path) == [8, 9]
    assert read_lines(tmp_path / "out.jsonl.1") == [6, 7]
    assert read_lines(tmp_path / "out.jsonl.2") == [4, 5]
    assert (s.written, s.errors, s.lost) == (10, 0, 0)


def test_rotation_keeps_every_file_within_max_bytes(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=25, backups=5)
    batches = [[line(0)], [line(1), line(2), line(3)], [line(4)], [line(5), line(6)], [line(7)]]
    for b in batches:
        s.write(b)
    s.close()
    # A batch bigger than the room left is split between two lines.
    names = ["out.jsonl.3", "out.jsonl.2", "out.jsonl.1", "out.jsonl"]
    assert files(tmp_path) == sorted(names)
    assert [read_lines(tmp_path / n) for n in names] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all((tmp_path / n).stat().st_size <= 25 for n in names)
    assert (s.written, s.errors, s.lost, s.bytes_written) == (8, 0, 0, 80)


def test_rotation_bound_holds_for_large_batches(tmp_path):
    # Issue 11: files reached 2.25x max_bytes (a whole batch went into one file).
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1000)
    n = 0
    for size in (1, 700, 3, 409, 410, 2000, 1):
        s.write([line(i % 1000) for i in range(n, n + size)])
        n += size
    s.close()
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert max(sizes.values()) <= 4096 and sum(sizes.values()) == n * 10
    newest = sizes.pop("out.jsonl")
    assert set(sizes.values()) == {4090} and newest == n * 10 % 4090   # every older file is full (409 lines)
    assert s.written == n


def test_a_line_longer_than_max_bytes_goes_alone_into_a_file(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=3)
    big = '{"data":"' + "x" * 5000 + '"}'
    s.write(["{}", big, "{}"])
    s.close()
    assert (tmp_path / "out.jsonl.2").read_bytes() == b"{}\n"
    assert (tmp_path / "out.jsonl.1").read_bytes() == big.encode() + b"\n"
    assert path.read_bytes() == b"{}\n"
    assert s.written == 3


def test_backups_zero(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=25, backups=0)
    for i in range(5):
        s.write([line(i)])
    s.close()
    assert files(tmp_path) == ["out.jsonl"]
    assert read_lines(path) == [4]
    assert s.written == 5


def test_appends_to_existing_file_and_counts_its_size(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n":900}\n{"n":901}\n')      # 20 bytes already there
    s = JsonlFileSink(str(path), max_bytes=25, backups=1)
    s.write([line(0)])
    s.close()
    assert read_lines(tmp_path / "out.jsonl.1") == [900, 901]
    assert read_lines(path) == [0]


def test_creates_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([line(1), line(2)])
    s.close()
    assert path.read_bytes() == b'{"n":001}\n{"n":002}\n'


def test_non_utf8_surrogates_written_as_bytes(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write(['{"comm":"caf\u00e9 \U0001F600"}', "\udcff"])
    s.close()
    assert path.read_bytes() == '{"comm":"café 😀"}\n'.encode() + b"\xff\n"


def test_empty_batch_writes_nothing(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([])
    s.close()
    assert files(tmp_path) == []
    assert (s.written, s.errors, s.lost) == (0, 0, 0)


def test_path_is_a_directory(tmp_path):
    s = JsonlFileSink(str(tmp_path), max_bytes=4096, backups=1)
    s.write([line(1), line(2)])
    s.write([line(3)])
    s.close()
    assert (s.written, s.errors, s.lost) == (0, 2, 3)


def test_parent_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    s = JsonlFileSink(str(tmp_path / "f" / "out.jsonl"), max_bytes=4096, backups=1)
    s.write([line(1)])
    assert (s.written, s.errors, s.lost) == (0, 1, 1)


def test_a_write_failing_midway_leaves_whole_lines_and_counts_exactly(tmp_path):
    # RLIMIT_FSIZE makes the kernel take part of a write, then refuse (EFBIG),
    # like a disk filling up; Python ignores SIGXFSZ.
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=1 << 20, backups=1)
    s.write([line(0)])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (15, hard))
    try:
        s.write([line(1), line(2)])       # 5 of its 20 bytes fit
        s.write([line(3)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    s.write([line(4)])                    # the limit lifted: recovered
    s.close()
    assert read_lines(path) == [0, 4]
    assert (s.written, s.errors, s.lost) == (2, 2, 3)


def test_failure_logged_at_most_every_10s(tmp_path, caplog):
    s = JsonlFileSink(str(tmp_path), max_bytes=4096, backups=1)
    with caplog.at_level(logging.ERROR, logger="exporter.sinks"):
        for _ in range(3):
            s.write([line(1)])
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["sink jsonl"]
    assert "write failed, 1 records lost so far" in caplog.records[0].getMessage()


def test_stdout_sink_writes_lines():
    r, w = os.pipe()
    s = StdoutSink(w)
    s.write([line(1), line(2)])
    os.close(w)
    with open(r, "rb") as f:
        assert f.read() == b'{"n":001}\n{"n":002}\n'
    assert (s.written, s.errors, s.lost) == (2, 0, 0)


def test_stdout_sink_closed_pipe():
    # Python ignores SIGPIPE, so a write to a pipe without a reader raises BrokenPipeError.
    r, w = os.pipe()
    os.close(r)
    s = StdoutSink(w)
    s.write([line(1), line(2)])
    s.write([line(3)])
    assert (s.written, s.errors, s.lost) == (0, 2, 3)
    os.close(w)                            # nothing is left buffered to fail later


def test_stdout_sink_closed_fd():
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    s = StdoutSink(w)
    s.write([line(1)])                     # EBADF
    assert (s.written, s.errors, s.lost) == (0, 1, 1)


def test_make():
    assert sinks.make(Output("none")) is None
    assert isinstance(sinks.make(Output("stdout")), StdoutSink)
    j = sinks.make(Output("jsonl", "/tmp/x.jsonl", 4096, 2, mode=0o640))
    assert isinstance(j, JsonlFileSink)
    assert (j.path, j.max_bytes, j.backups, j.mode, j._f) == ("/tmp/x.jsonl", 4096, 2, 0o640, None)  # opened by open()


def test_base_sink_counts():
    s = Sink()
    s.write([line(1)])
    assert (s.name, s.written, s.errors, s.lost) == ("none", 1, 0, 0)
