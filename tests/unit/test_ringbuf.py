"""exporter.ringbuf.walk: the record-by-record decoder over ring-format bytes
never raises, skips what it must and counts what is bad."""
from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from exporter.records import LOG, RB_BUSY, RB_DISCARD, RECORDS
from exporter.ringbuf import walk

SIZE = LOG.itemsize          # 56: one log record
STRIDE = 64                  # 8-byte header + 56


def rec(pid: int) -> bytes:
    a = np.zeros((), LOG)
    a["pid"] = pid
    a["comm"] = b"t%d" % pid
    return a.tobytes()


def slot(body: bytes, length: int = None, flags: int = 0) -> bytes:
    n = len(body) if length is None else length
    b = struct.pack("<II", n | flags, 0) + body
    return b + b"\0" * (-len(b) % 8)


def good(pid: int) -> bytes:
    return slot(rec(pid))


def result(buf, **kw):
    recs, bad, pos = walk(buf, LOG, **kw)
    return [int(p) for p in recs["pid"]], bad, pos


def test_empty():
    assert result(b"") == ([], 0, 0)


def test_good_records():
    recs, bad, pos = walk(good(1) + good(2), LOG)
    assert (recs["pid"].tolist(), recs["comm"].tolist(), bad, pos) == ([1, 2], [b"t1", b"t2"], 0, 128)
    assert recs.dtype == LOG


def test_discard_skipped_not_bad():
    buf = good(1) + slot(rec(2), flags=RB_DISCARD) + good(3)
    assert result(buf) == ([1, 3], 0, 3 * STRIDE)


def test_discarded_wrong_size_is_not_bad():
    buf = slot(b"\x01" * 8, flags=RB_DISCARD) + good(1)
    assert result(buf) == ([1], 0, 16 + STRIDE)


def test_busy_stops_the_walk():
    buf = good(1) + slot(rec(2), flags=RB_BUSY) + good(3)
    assert result(buf) == ([1], 0, STRIDE)


def test_busy_and_discard_stops_the_walk():
    buf = slot(rec(2), flags=RB_BUSY | RB_DISCARD) + good(3)
    assert result(buf) == ([], 0, 0)


def test_zero_length_header_counted_bad_and_skipped():
    buf = struct.pack("<II", 0, 0) + good(1)
    assert result(buf) == ([1], 1, 8 + STRIDE)


def test_all_zero_bytes():
    assert result(bytes(64)) == ([], 8, 64)


def test_all_ff_bytes_is_busy():
    assert result(b"\xff" * 64) == ([], 0, 0)


@pytest.mark.parametrize("n", [1, 8, SIZE - 8, SIZE + 8, 504])
def test_wrong_size_counted_bad_and_skipped(n):
    wrong = slot(b"\xab" * n)
    buf = good(1) + wrong + good(2)
    assert result(buf) == ([1, 2], 1, 2 * STRIDE + len(wrong))


def test_cut_short_counted_bad():
    buf = good(1) + good(2)[:40]
    assert result(buf) == ([1], 1, len(buf))


def test_huge_length_is_cut_short():
    buf = good(1) + struct.pack("<II", 0x3FFFFFFF, 0) + bytes(56)
    assert result(buf) == ([1], 1, len(buf))


def test_trailing_partial_header_ends_walk():
    buf = good(1) + b"\x38\x00\x00"          # 3 bytes: not even a header
    recs, _, pos = walk(buf, LOG)
    assert (recs["pid"].tolist(), pos) == ([1], STRIDE)


def test_start_and_end():
    buf = good(1) + good(2) + good(3)
    assert result(buf, start=STRIDE, end=2 * STRIDE) == ([2], 0, 2 * STRIDE)


def test_end_inside_a_record_is_cut_short():
    buf = good(1) + good(2)
    assert result(buf, end=STRIDE + 20) == ([1], 1, STRIDE + 20)


def test_memoryview_input():
    buf = memoryview(bytearray(good(1) + good(2)))
    assert result(buf) == ([1, 2], 0, 128)


def test_records_are_copies():
    buf = bytearray(good(7))
    recs, _, _ = walk(memoryview(buf), LOG)
    buf[:] = bytes(len(buf))
    assert recs["pid"].tolist() == [7]


@pytest.mark.parametrize("ring", list(RECORDS))
def test_random_garbage_never_raises(ring):
    rnd = random.Random(42)
    for _ in range(2000):
        n = rnd.choice([0, 1, 7, 8, 9, 63, 64, 65, 511, 512, 4096])
        buf = bytes(rnd.getrandbits(8) for _ in range(n))
        recs, bad, pos = walk(buf, RECORDS[ring])
        assert recs.dtype == RECORDS[ring]
        assert bad >= 0 and 0 <= pos <= n


def test_random_garbage_with_small_lengths_is_counted():
    # Headers with BUSY clear and lengths < 64: every header is visited and
    # each one not of the record's size is counted bad (DISCARD ones skipped).
    rnd = random.Random(7)
    for _ in range(500):
        slots, want_bad, want_good = [], 0, 0
        for _ in range(rnd.randrange(1, 20)):
            n = rnd.choice([0, 1, 8, 16, SIZE, SIZE, 57])
            flags = rnd.choice([0, 0, RB_DISCARD])
            if n == 0:
                want_bad += 1                   # zero length counts bad, DISCARD or not
                slots.append(struct.pack("<II", flags, 0))
                continue
            slots.append(slot(bytes(rnd.getrandbits(8) for _ in range(n)), flags=flags))
            if not flags:
                want_bad += n != SIZE
                want_good += n == SIZE
        buf = b"".join(slots)
        recs, bad, pos = walk(buf, LOG)
        assert (len(recs), bad, pos) == (want_good, want_bad, len(buf))
