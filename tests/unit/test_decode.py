"""``nettap --decode`` on inputs that are not (only) kind records: a record
cut short in the middle, garbage between records, another kind's records,
an endless device. The input is streamed, each problem is reported with its
offset and the rest still decoded, and the exit status says whether all of
the input was records."""
from __future__ import annotations

import io
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from exporter.capture import records as R
from exporter.capture.decode import GARBAGE_MAX, Decoder
from tests.oracles import reference_jsonl

from .record_fixtures import FIX, KINDS, ROOT, mf, ring_of


def _slots(kind: str) -> list:
    return [mf.slot(mf.record(kind, s)) for s in mf.good_records(kind)]


def _golden_lines(kind: str) -> list:
    return (FIX / f"{mf.FILES[kind]}.jsonl").read_bytes().splitlines(keepends=True)


def decode(data: bytes, kind: str, read_size: int = 1 << 20, garbage_max: int = GARBAGE_MAX):
    problems = []
    dec = Decoder(ring_of(kind), lambda off, msg: problems.append((off, msg)), read_size=read_size,
                  garbage_max=garbage_max)
    out = b"".join(reference_jsonl(k, recs) for k, recs in dec.records(io.BytesIO(data)))
    return out, problems, dec.result


def cli(path: str, ring: str, timeout: int = 60):
    return subprocess.run([sys.executable, "-m", "exporter", "--decode", path, "--ring", ring],
                          cwd=ROOT, capture_output=True, timeout=timeout)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("read_size", [1 << 20, 7, 4096])
def test_fixture_decodes_to_golden_whatever_the_piece_size(kind, read_size):
    out, problems, res = decode((FIX / f"{mf.FILES[kind]}.bin").read_bytes(), kind, read_size)
    assert out == b"".join(_golden_lines(kind))
    assert res.bad == mf.BAD_RECORDS == len(problems)
    assert "not" in problems[0][1] and "cut short by the end of input" in problems[1][1]


@pytest.mark.parametrize("kind", KINDS)
def test_cut_record_in_the_middle_does_not_hide_the_rest(kind):
    slots = _slots(kind)
    cut = slots[0][:R.RB_HDR + R.DTYPES[kind].itemsize // 2]
    data = b"".join(slots[:3]) + cut + b"".join(slots[3:])
    out, problems, res = decode(data, kind)
    assert out.splitlines(keepends=True) == [_golden_lines(kind)[i] for i in _good_order(kind)]
    assert problems == [(sum(map(len, slots[:3])), problems[0][1])]
    assert "record cut short" in problems[0][1]
    assert (res.records, res.bad, res.offset) == (len(slots), 1, len(data))


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_between_records_is_skipped_and_reported(kind):
    slots = _slots(kind)
    junk = bytes(random.Random(1).getrandbits(8) for _ in range(1001)) + b"\0" * 3000
    data = b"".join(slots[:2]) + junk + b"".join(slots[2:])
    out, problems, res = decode(data, kind, read_size=512)
    assert len(out.splitlines()) == len(slots)
    assert [off for off, _ in problems] == [len(slots[0]) + len(slots[1])]
    assert problems[0][1] == f"{len(junk)} byte(s) are not records"
    assert res.bad == 1


def test_all_valid_input_exits_0(tmp_path):
    f = tmp_path / "ok.bin"
    f.write_bytes(b"".join(_slots("log")))
    p = cli(str(f), "logs")
    assert (p.returncode, p.stderr) == (0, b"")
    assert p.stdout.splitlines(keepends=True) == [_golden_lines("log")[i] for i in _good_order("log")]


@pytest.mark.parametrize("kind", KINDS)
def test_cli_decode_exits_1_and_names_each_problem(kind):
    path = str(FIX / f"{mf.FILES[kind]}.bin")
    p = cli(path, ring_of(kind))
    assert p.returncode == 1
    assert p.stdout == b"".join(_golden_lines(kind))
    err = p.stderr.decode().splitlines()
    assert len(err) == 3
    assert all(line.startswith(f"nettap: {path}: ") for line in err)
    assert " offset " in err[0] and " offset " in err[1]
    assert err[2].endswith(f"{len(mf.good_records(kind))} record(s) decoded, 2 bad record(s) or stretch(es) "
                           f"of garbage skipped (in {os.path.getsize(path)} bytes read)")


def test_other_rings_records_are_not_records_of_this_ring():
    p = cli(str(FIX / "log.bin"), "capture_chunks")
    assert (p.returncode, p.stdout) == (1, b"")
    assert b"are not records" in p.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_of_another_kind_is_not_a_record_of_this_ring(kind):
    """The kind's record size, but another kind in its header: reported and
    skipped, never printed as this kind's kind."""
    slots = _slots(kind)
    other = bytearray(slots[1])
    off = R.RB_HDR + R.KIND_FIELD[0]
    number = next(n for k, n in R.NUMBERS.items() if ring_of(k) != ring_of(kind))      # another ring's kind
    other[off:off + R.KIND_FIELD[1]] = number.to_bytes(R.KIND_FIELD[1], "little")
    data = slots[0] + bytes(other) + b"".join(slots[2:])
    out, problems, res = decode(data, kind)
    want = [line for i, line in enumerate(reference_jsonl(kind, np.frombuffer(
        b"".join(mf.record(kind, s) for s in mf.good_records(kind)), R.DTYPES[kind])).splitlines(keepends=True))
        if i != 1]
    assert out.splitlines(keepends=True) == want
    assert (res.bad, len(problems), problems[0][0]) == (1, 1, len(slots[0]))


def test_dev_zero_stops_after_a_bounded_amount_with_exit_1():
    p = cli("/dev/zero", "capture_eof", timeout=60)
    assert (p.returncode, p.stdout) == (1, b"")
    err = p.stderr.decode()
    assert "MemoryError" not in err and "Traceback" not in err
    assert err.splitlines()[0] == (f"nettap: /dev/zero: offset 0: no {R.EOF_.itemsize}-byte record in the "
                                   f"{GARBAGE_MAX} bytes from here: stopped (is this capture_eof records?)")


def test_garbage_stop_is_bounded_in_memory_and_input():
    class Endless(io.RawIOBase):
        read_total = 0

        def readable(self):
            return True

        def read(self, n=-1):
            assert 0 < n <= 4096                  # never asked for everything
            Endless.read_total += n
            return b"\0" * n
    dec = Decoder("logs", lambda off, msg: None, read_size=4096, garbage_max=1 << 16)
    assert list(dec.records(Endless())) == []
    assert dec.result.gave_up and dec.result.bad == 1
    assert Endless.read_total < (1 << 16) + 4 * (1 << 17) + 4096


def _good_order(kind: str) -> list:
    """Golden line indices in the order of good_records (the golden has them in that order)."""
    return list(range(len(mf.good_records(kind))))


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_cut_spliced_and_random_inputs_never_raise(kind):
    """Random cuts, splices, byte flips and noise around real records (issue
    45: a record header in the input's last 7 bytes met during a resync
    raised TypeError): the decoder never raises, and everything it consumes
    is a record or a counted bad stretch."""
    rng = random.Random(45)
    slots = _slots(kind)
    whole = b"".join(slots)
    heads = [n.to_bytes(4, "little") for n in {R.DTYPES[k].itemsize for k in R.RING_KINDS[ring_of(kind)]}]
    for i in range(400):
        a, b = sorted(rng.randrange(len(whole) + 1) for _ in range(2))
        data = bytearray(whole[a:b] + whole[rng.randrange(len(whole)):])
        for _ in range(rng.randrange(4)):
            if data:
                data[rng.randrange(len(data))] = rng.getrandbits(8)
        # what ends the input: a record header cut at each of its last bytes, noise or nothing
        tail = rng.choice([rng.choice(heads)[:rng.randrange(1, 5)] + bytes(rng.randrange(4)),
                           rng.choice(heads) + bytes(rng.randrange(4)), bytes(rng.getrandbits(8)
                                                                               for _ in range(rng.randrange(9))), b""])
        data = bytes(data[:rng.randrange(len(data) + 1)]) + tail
        out, problems, res = decode(data, kind, read_size=rng.choice([7, 64, 1 << 20]))
        assert res.offset == len(data), (i, data.hex())
        assert res.bad == len(problems)
        assert len(out.splitlines()) == res.records
