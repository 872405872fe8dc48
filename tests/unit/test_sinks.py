"""exporter.capture.sinks: size rotation keeps whole lines and N backups; a failed
write is counted (errors, lost) and never raises."""
from __future__ import annotations

import logging
import os
import resource
import stat
from pathlib import Path

import pytest

from exporter.capture import sinks
from exporter.config import Output
from exporter.capture.sinks import JsonlFileSink, Sink, StdoutSink


def line(i: int) -> str:
    return f'{{"n":{i:03d}}}'            # 9 characters: 10 bytes with its newline


def read_lines(p: Path):
    data = p.read_bytes()
    assert data.endswith(b"\n")          # no line is split at a file's end
    return [int(x[5:8]) for x in data.decode().splitlines()]


def write_numbered(path: Path, n: int, **rotation) -> JsonlFileSink:
    """Lines 0 .. n - 1 written one at a time to a JsonlFileSink at path; the sink, closed."""
    s = JsonlFileSink(str(path), **rotation)
    for i in range(n):
        s.write([line(i)])
    s.close()
    return s


def files(d: Path):
    return sorted(p.name for p in d.iterdir())


def test_rotation_keeps_n_backups(tmp_path):
    path = tmp_path / "out.jsonl"
    s = write_numbered(path, 10, max_bytes=25, backups=2)
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
    s = write_numbered(path, 5, max_bytes=25, backups=0)
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
    with caplog.at_level(logging.ERROR, logger="exporter.capture.sinks"):
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


# -- the output path is not trusted (issue 11: root appended to whatever a user linked there) --

def other_uid() -> int:
    return 65534 if os.geteuid() != 65534 else 65533


def refusal(s: JsonlFileSink) -> str:
    with pytest.raises(OSError) as e:
        s.open()
    return str(e.value)


def test_a_link_at_the_path_is_refused_and_its_target_untouched(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret\n")
    path = tmp_path / "out.jsonl"
    path.symlink_to(victim)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    assert refusal(s) == f"{path} is a symbolic link: nettap does not follow links for its output"
    with caplog.at_level(logging.ERROR, logger="exporter.capture.sinks"):
        s.write([line(1)])
    assert victim.read_bytes() == b"secret\n"
    assert (s.written, s.errors, s.lost) == (0, 1, 1)
    assert "is a symbolic link" in caplog.records[0].getMessage()


def test_a_link_planted_at_a_backup_name_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret\n")
    d = tmp_path / "out"
    d.mkdir()
    (d / "out.jsonl.2").symlink_to(victim)
    (d / "out.jsonl.1").write_bytes(b"")
    os.chmod(d / "out.jsonl.1", 0o600)
    s = JsonlFileSink(str(d / "out.jsonl"), max_bytes=25, backups=2)
    for i in range(3):
        s.write([line(i), line(i)])
    s.close()
    assert victim.read_bytes() == b"secret\n"
    assert not (d / "out.jsonl.2").is_symlink()


def test_a_file_of_another_user_is_refused(tmp_path):
    # In /tmp itself (root's, sticky): only the file's owner is in question.
    path = Path("/tmp") / f"nettap-test-{os.getpid()}-{tmp_path.name}.jsonl"
    path.write_bytes(b"")
    try:
        os.chmod(path, 0o600)
        s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
        s.uid = other_uid()            # nettap runs as another user than the file's owner
        assert refusal(s) == (f"{path} is owned by uid {os.geteuid()}, not nettap's uid {s.uid}: "
                              "its owner could read the captured traffic")
        s.write([line(1)])
        assert path.read_bytes() == b"" and (s.written, s.lost) == (0, 1)
    finally:
        path.unlink()


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_group_or_world_writable_file_is_refused(tmp_path, mode):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"")
    os.chmod(path, mode)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    assert refusal(s) == f"{path} is group- or world-writable (mode {mode:04o}): others could alter the capture"
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_hard_link_is_refused(tmp_path):
    other = tmp_path / "other"
    other.write_bytes(b"x\n")
    os.chmod(other, 0o600)
    os.link(other, tmp_path / "out.jsonl")
    s = JsonlFileSink(str(tmp_path / "out.jsonl"), max_bytes=4096, backups=1)
    assert "has 2 hard links" in refusal(s)
    assert other.read_bytes() == b"x\n"


def test_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "out.jsonl", 0o600)
    s = JsonlFileSink(str(tmp_path / "out.jsonl"), max_bytes=4096, backups=1)
    assert refusal(s).endswith("is not a regular file")


def test_a_world_writable_directory_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o777)
    s = JsonlFileSink(str(d / "out.jsonl"), max_bytes=4096, backups=1)
    assert refusal(s) == (f"directory {d} is world-writable without the sticky bit: any user could swap "
                          "the output file for a link or a file of theirs")
    assert not (d / "out.jsonl").exists()
    os.chmod(d, 0o1777)                 # like /tmp: others cannot touch nettap's file
    s.open()
    s.close()


def test_a_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    s = JsonlFileSink(str(d / "out.jsonl"), max_bytes=4096, backups=1)
    if os.geteuid() == 0:
        os.chown(d, other_uid(), -1)
        owner, where = other_uid(), d
    else:                               # nettap runs as another user than the test's directories' owner
        s.uid = other_uid()
        owner, where = os.geteuid(), None
    msg = refusal(s)
    assert f"is owned by uid {owner}, neither root nor nettap's uid {s.uid}" in msg
    if where:
        assert msg.startswith(f"directory {where} ")
    assert not (d / "out.jsonl").exists()


def test_links_in_the_directory_path_are_resolved_first(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    s = JsonlFileSink(str(tmp_path / "link" / "out.jsonl"), max_bytes=4096, backups=1)
    s.write([line(1)])
    s.close()
    assert read_lines(real / "out.jsonl") == [1]


def test_files_are_created_with_the_configured_mode_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        s = JsonlFileSink(str(tmp_path / "out.jsonl"), max_bytes=25, backups=1)
        for i in range(3):                   # and after a rotation
            s.write([line(i), line(i)])
        s.close()
        t = JsonlFileSink(str(tmp_path / "b.jsonl"), max_bytes=4096, backups=1, mode=0o640)
        t.write([line(1)])
        t.close()
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"out.jsonl": 0o600, "out.jsonl.1": 0o600, "b.jsonl": 0o640}


def test_an_existing_own_file_gets_the_configured_mode(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"")
    os.chmod(path, 0o644)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.open()
    s.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_uncreatable_path_is_refused_at_open(tmp_path):
    (tmp_path / "f").write_text("")
    s = JsonlFileSink(str(tmp_path / "f" / "d" / "out.jsonl"), max_bytes=4096, backups=1)
    assert refusal(s) == f"{tmp_path / 'f'} is not a directory (or is a link made after the path was resolved)"
    s = JsonlFileSink("/proc/nettap-test/out.jsonl", max_bytes=4096, backups=1)
    assert refusal(s).startswith("cannot create directory /proc/nettap-test: ")


# -- a deleted file or directory (issue 11: writes went to the unlinked file, counted as written) --

def test_a_deleted_file_is_created_again(tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([line(1)])
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="exporter.capture.sinks"):
        s.write([line(2), line(3)])
    s.close()
    assert read_lines(path) == [2, 3]
    assert (s.written, s.errors, s.lost) == (3, 0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        f"sink jsonl: {path} was deleted or moved away; writing to a new one"]


def test_a_file_moved_away_is_not_written_on(tmp_path):
    path = tmp_path / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([line(1)])
    path.rename(tmp_path / "shipped")
    s.write([line(2)])
    s.close()
    assert read_lines(tmp_path / "shipped") == [1]
    assert read_lines(path) == [2]


def test_a_deleted_directory_counts_records_lost_until_it_is_back(tmp_path, caplog):
    d = tmp_path / "d"
    path = d / "out.jsonl"
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([line(1)])
    path.unlink()
    d.rmdir()
    with caplog.at_level(logging.WARNING, logger="exporter.capture.sinks"):
        s.write([line(2), line(3)])
        s.write([line(4)])
        assert not d.exists()            # the directory is the admin's: not made again
        d.mkdir()
        s.write([line(5)])
    s.close()
    assert read_lines(path) == [5]
    assert (s.written, s.errors, s.lost) == (2, 2, 3)
    assert [r.getMessage() for r in caplog.records] == [
        f"sink jsonl: directory {d} was deleted: records are counted lost "
        "(nettap_records_lost_total{stage=\"sink\"}) until it exists again",
        f"sink jsonl: directory {d} is back; writing to {path} again"]


# -- a cut last line (issue 11: after kill -9 the next record was glued onto it) --

def test_a_cut_last_line_is_ended_and_counted_lost(tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n":900}\n{"n":9')
    os.chmod(path, 0o600)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    with caplog.at_level(logging.WARNING, logger="exporter.capture.sinks"):
        s.write([line(1)])
    s.close()
    assert path.read_bytes() == b'{"n":900}\n{"n":9\n{"n":001}\n'
    assert (s.written, s.lost) == (1, 1)
    assert "ended with a cut line" in caplog.records[0].getMessage()


def test_a_whole_last_line_is_left_alone(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n":900}\n')
    os.chmod(path, 0o600)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    s.write([line(1)])
    s.close()
    assert read_lines(path) == [900, 1] and s.lost == 0


def test_a_second_sink_on_a_file_this_process_writes_does_not_cut_its_line(tmp_path):
    # A reload opens the new sink while the old one may be mid-write.
    path = tmp_path / "out.jsonl"
    first = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    first.open()
    os.write(first._f, b'{"n":0')         # the old sink's batch, half written
    second = JsonlFileSink(str(path), max_bytes=4096, backups=1)
    second.open()
    os.write(first._f, b'01}\n')
    first.close()
    second.write([line(2)])
    second.close()
    assert read_lines(path) == [1, 2] and second.lost == 0


# -- counters for the process's life (issue 11: they restarted from 0 at every sink swap) --

def test_counters_carry_over_to_the_next_sink(tmp_path):
    totals = sinks.Totals()
    a = sinks.make(Output("jsonl", str(tmp_path / "a.jsonl"), 4096, 1, root=str(tmp_path)), totals)
    a.write([line(1), line(2)])
    a.write_data(b"\xff", 1)              # not a whole line: still counted by bytes
    a.close()
    tmp_path.joinpath("gone").mkdir()
    b = sinks.make(Output("jsonl", str(tmp_path / "gone" / "b.jsonl"), 4096, 1, root=str(tmp_path)), totals)
    b.open()
    tmp_path.joinpath("gone", "b.jsonl").unlink()
    tmp_path.joinpath("gone").rmdir()
    b.write([line(3)])                    # lost: its directory is gone
    c = sinks.make(Output("jsonl", str(tmp_path / "c.jsonl"), 4096, 1, root=str(tmp_path)), totals)
    c.write([line(4)])
    assert (c.written, c.bytes_written, c.errors, c.lost) == (4, 31, 1, 1)
    r, w = os.pipe()
    os.close(r)
    out = StdoutSink(w, totals)
    out.write_data(b"x\n", 1)            # EPIPE
    os.close(w)
    assert (out.name, out.written, out.errors, out.lost) == ("stdout", 0, 1, 2)
    assert (c.written, c.errors) == (4, 1)     # per sink name


# -- only inside output.root, and a refused file left as it was (issue 45) --

def test_a_directory_resolving_outside_the_root_is_refused_and_nothing_made(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "out").symlink_to(tmp_path / "elsewhere")
    s = JsonlFileSink(str(root / "out" / "new" / "x.jsonl"), max_bytes=4096, backups=1, root=str(root))
    assert refusal(s) == (f"directory {root / 'out' / 'new'} resolves to {tmp_path / 'elsewhere' / 'new'}, "
                          f"outside output.root {root}: nettap writes only inside its own directory")
    assert not list((tmp_path / "elsewhere").iterdir())


def test_directories_are_made_only_inside_the_root(tmp_path):
    s = JsonlFileSink(str(tmp_path / "a" / "b" / "x.jsonl"), max_bytes=4096, backups=1, root=str(tmp_path / "a" / "b"))
    assert refusal(s) == (f"directory {tmp_path / 'a'} does not exist (nettap makes directories only inside "
                          f"output.root {tmp_path / 'a' / 'b'})")
    assert not (tmp_path / "a").exists()
    s = JsonlFileSink(str(tmp_path / "a" / "b" / "x.jsonl"), max_bytes=4096, backups=1, root=str(tmp_path / "a"))
    s.write([line(1)])
    s.close()
    assert read_lines(tmp_path / "a" / "b" / "x.jsonl") == [1]


@pytest.mark.parametrize("what", ["hard link", "world-writable", "fifo", "device"])
def test_a_refused_file_keeps_its_mode_and_bytes(tmp_path, what):
    """Nothing is changed before every check passed: no chmod of a file
    refused, no open of a FIFO or a device (looked at through O_PATH)."""
    path = tmp_path / "out.jsonl"
    if what == "fifo":
        os.mkfifo(path, 0o644)
    elif what == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a device needs root")
        os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 3))      # /dev/null's numbers
    else:
        path.write_bytes(b"theirs\n")
        os.chmod(path, 0o646 if what == "world-writable" else 0o644)
        if what == "hard link":
            os.link(path, tmp_path / "second-name")
    before = os.stat(path)
    s = JsonlFileSink(str(path), max_bytes=4096, backups=1, mode=0o600, root=str(tmp_path))
    refusal(s)
    after = os.stat(path)
    assert (after.st_mode, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == \
        (before.st_mode, before.st_size, before.st_mtime_ns, before.st_ctime_ns)


def test_a_kernel_file_system_is_refused_before_any_file_is_touched():
    """Issue 45: a sysfs file passed the file checks (root's, 0644, one
    link), was chmodded, and only then failed. A directory on a file system
    of kernel objects is refused before any of its files is opened."""
    d = "/sys/kernel/mm/transparent_hugepage"
    path = os.path.join(d, "hpage_pmd_size")
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this kernel")
    before = os.stat(path)
    s = JsonlFileSink(path, max_bytes=4096, backups=1, mode=0o600, root=d)
    assert refusal(s) == (f"directory {d} is on a sysfs file system: its files are kernel objects (a write "
                          "or a chmod changes the kernel), not nettap's files")
    assert os.stat(path).st_mode == before.st_mode
    s = JsonlFileSink("/proc/self/x.jsonl", max_bytes=4096, backups=1, root="/proc")
    assert refusal(s).endswith("is on a proc file system: its files are kernel objects (a write or a chmod "
                               "changes the kernel), not nettap's files")
