"""The ring reader's walk over ring-format bytes (exporter/capture/scan.c's
scan, what RingMemory.read runs) never fails on garbage, skips what it must
and counts what is bad, and agrees on every case with the plain Python
walk in tests/oracles.py; its positions (scan.c's positions and release)
are the kernel's u64s at the start of their pages."""
from __future__ import annotations

import mmap
import os
import random
import struct

import numpy as np
import pytest

from exporter.capture import records as R
from exporter.capture.records import LOG, RB_BUSY, RB_DISCARD, RECORDS
from exporter.capture.ringbuf import RingMemory
from tests.oracles import walk

SIZE = LOG.itemsize          # 72: one log record
STRIDE = 80                  # 8-byte header + 72


def rec(pid: int, kind: int = R.NUMBERS["log"]) -> bytes:
    a = np.zeros((), LOG)
    a["kind"] = kind
    a["pid"] = pid
    a["comm"] = b"t%d" % pid
    return a.tobytes()


def slot(body: bytes, length: int = None, flags: int = 0) -> bytes:
    n = len(body) if length is None else length
    b = struct.pack("<II", n | flags, 0) + body
    return b + b"\0" * (-len(b) % 8)


def good(pid: int) -> bytes:
    return slot(rec(pid))


COPY = R.compiled.SCAN_COPY  # the scan's mode that copies the records out


def scan(buf, record=LOG, start=0, end=None):
    """The compiled walk over buf[start:end], as RingMemory.read runs it on
    ring memory (a power-of-two area; here buf at its start, zeros after)."""
    end = len(buf) if end is None else end
    size = 64
    while size < max(len(buf), record.itemsize + 8):
        size *= 2
    area = bytearray(size)
    area[:len(buf)] = bytes(buf)
    ring = next(r for r, d in RECORDS.items() if d == record)
    out, consumed, kept, bad, _ = R.compiled.scan(R.MASKS[ring], area, start, end - start, 1 << 20, COPY)
    recs = np.frombuffer(out, dtype=record)
    assert len(recs) == kept
    return recs, bad, start + consumed


def both(buf, record=LOG, **kw):
    """The oracle's walk and the compiled one, which must agree."""
    want = walk(buf, record, **kw)
    got = scan(buf, record, **kw)
    assert (got[0].tobytes(), got[1], got[2]) == (want[0].tobytes(), want[1], want[2])
    return got


def result(buf, **kw):
    recs, bad, pos = both(buf, LOG, **kw)
    return [int(p) for p in recs["pid"]], bad, pos


def test_empty():
    assert result(b"") == ([], 0, 0)


def test_good_records():
    recs, bad, pos = both(good(1) + good(2), LOG)
    assert (recs["pid"].tolist(), recs["comm"].tolist(), bad, pos) == ([1, 2], [b"t1", b"t2"], 0, 2 * STRIDE)
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


@pytest.mark.parametrize("n", [1, 8, SIZE - 8, SIZE + 8, 504, 5000])
def test_wrong_size_counted_bad_and_skipped(n):
    wrong = slot(b"\xab" * n)
    buf = good(1) + wrong + good(2)
    assert result(buf) == ([1, 2], 1, 2 * STRIDE + len(wrong))


@pytest.mark.parametrize("kind", [0, R.KINDS["capture_chunks"], R.KINDS["capture_eof"], 99, 2**32 - 1])
def test_a_record_of_another_kind_is_counted_bad_and_skipped(kind):
    """The length of the ring's kind, but another kind (or none) in its header."""
    buf = good(1) + slot(rec(2, kind)) + good(3)
    assert result(buf) == ([1, 3], 1, 3 * STRIDE)


def test_a_ring_of_two_kinds_gives_each_its_lines_in_ring_order():
    eof = np.zeros((), R.EOF_)
    eof["kind"], eof["pid"], eof["conn_id"] = R.KINDS["capture_eof"], 5, 77
    buf = good(1) + slot(eof.tobytes()) + good(2) + slot(b"\xab" * 40)
    area = bytearray(1024)
    area[:len(buf)] = buf
    mask = R.MASKS["logs"] | R.MASKS["capture_eof"]
    out, consumed, kept, bad, stop = R.compiled.scan(mask, area, 0, len(buf), 100, 1)
    assert (consumed, kept, bad, stop) == (len(buf), 3, 1, 0)
    lines = out.decode().splitlines()
    assert [line.split('"type":')[1] for line in lines] == ['"log"}', '"eof"}', '"log"}']
    assert lines[1] == R.jsonl("capture_eof", np.frombuffer(eof.tobytes(), R.EOF_)).decode().rstrip("\n")
    assert R.compiled.scan(mask, area, 0, len(buf), 100, 0)[1:] == (len(buf), 3, 1, 0)
    with pytest.raises(ValueError, match="one to copy"):          # copies are of one dtype
        R.compiled.scan(mask, area, 0, len(buf), 100, COPY)
    counts = np.zeros(R.KINDS_MAX, dtype=np.uint64)               # kept records by kind, added to
    for mode in (0, 1):
        R.compiled.scan(mask, area, 0, len(buf), 100, mode, counts)
    want = np.zeros(R.KINDS_MAX, dtype=np.uint64)
    want[R.KINDS["logs"]], want[R.KINDS["capture_eof"]] = 4, 2
    assert (counts == want).all()
    for bad in (np.zeros(R.KINDS_MAX - 1, dtype=np.uint64), bytes(8 * R.KINDS_MAX)):   # short; read-only
        with pytest.raises((ValueError, BufferError, TypeError)):
            R.compiled.scan(mask, area, 0, len(buf), 100, 0, bad)
    assert (counts == want).all()


@pytest.mark.parametrize("mask", [0, 1, 1 << 20, 1 << 40])
def test_a_mask_of_no_known_kind_is_refused(mask):
    with pytest.raises(ValueError):
        R.compiled.scan(mask, bytearray(1024), 0, 8, 1, 0)


def test_cut_short_counted_bad():
    buf = good(1) + good(2)[:40]
    assert result(buf) == ([1], 1, len(buf))


def test_huge_length_is_cut_short():
    buf = good(1) + struct.pack("<II", 0x3FFFFFFF, 0) + bytes(SIZE)
    assert result(buf) == ([1], 1, len(buf))


def test_trailing_partial_header_ends_walk():
    buf = good(1) + b"\x38\x00\x00"          # 3 bytes: not even a header
    recs, _, pos = both(buf, LOG)
    assert (recs["pid"].tolist(), pos) == ([1], STRIDE)


def test_start_and_end():
    buf = good(1) + good(2) + good(3)
    assert result(buf, start=STRIDE, end=2 * STRIDE) == ([2], 0, 2 * STRIDE)


def test_end_inside_a_record_is_cut_short():
    buf = good(1) + good(2)
    assert result(buf, end=STRIDE + 20) == ([1], 1, STRIDE + 20)


def test_memoryview_input():
    buf = memoryview(bytearray(good(1) + good(2)))
    assert result(buf) == ([1, 2], 0, 2 * STRIDE)


def test_records_are_copies():
    buf = bytearray(good(7))
    recs, _, _ = both(memoryview(buf), LOG)
    buf[:] = bytes(len(buf))
    assert recs["pid"].tolist() == [7]


@pytest.mark.parametrize("ring", list(RECORDS))
def test_random_garbage_never_raises(ring):
    rnd = random.Random(42)
    for _ in range(2000):
        n = rnd.choice([0, 1, 7, 8, 9, 63, 64, 65, 511, 512, 4096])
        buf = bytes(rnd.getrandbits(8) for _ in range(n))
        recs, bad, pos = both(buf, RECORDS[ring])
        assert recs.dtype == RECORDS[ring]
        assert bad >= 0 and 0 <= pos <= n


def test_random_garbage_with_small_lengths_is_counted():
    # Headers with BUSY clear and short lengths: every header is visited and
    # each one not of the record's size and kind is counted bad (DISCARD ones
    # skipped); a random body of the record's size is the ring's kind only by
    # chance, a real record always.
    rnd = random.Random(7)
    for _ in range(500):
        slots, want_bad, want_good = [], 0, 0
        for _ in range(rnd.randrange(1, 20)):
            n = rnd.choice([0, 1, 8, 16, SIZE, SIZE, 57, "record"])
            flags = rnd.choice([0, 0, RB_DISCARD])
            if n == 0:
                want_bad += 1                   # zero length counts bad, DISCARD or not
                slots.append(struct.pack("<II", flags, 0))
                continue
            body = rec(rnd.getrandbits(32)) if n == "record" else bytes(rnd.getrandbits(8) for _ in range(n))
            slots.append(slot(body, flags=flags))
            if not flags:
                ok = len(body) == SIZE and body[16:20] == rec(0)[16:20]
                want_bad += not ok
                want_good += ok
        buf = b"".join(slots)
        recs, bad, pos = both(buf, LOG)
        assert (len(recs), bad, pos) == (want_good, want_bad, len(buf))


def test_a_record_crossing_the_end_of_the_area_is_read_whole():
    """After a record of a foreign size the walk is off the stride, and a
    record's body may cross the end of the (once-mapped) area: it is read
    whole, its start from the end and its rest from the start."""
    body = rec(9)
    area = bytearray(128)
    area[80:88] = struct.pack("<II", SIZE, 0)      # the header at 80, the body 88..159 -> 88..127 + 0..31
    area[88:128] = body[:40]
    area[0:SIZE - 40] = body[40:]
    out, consumed, kept, bad, _ = R.compiled.scan(R.MASKS["logs"], area, 80, STRIDE, 100, COPY)
    assert (kept, bad, consumed) == (1, 0, STRIDE)
    assert out == body


def test_max_records_and_a_busy_record_stop_the_scan():
    buf = good(1) + good(2) + good(3) + slot(rec(4), flags=RB_BUSY)
    area = bytearray(512)
    area[:len(buf)] = buf
    assert R.compiled.scan(R.MASKS["logs"], area, 0, len(buf), 2, COPY)[1:] == (2 * STRIDE, 2, 0, 2)
    assert R.compiled.scan(R.MASKS["logs"], area, 0, len(buf), 9, COPY)[1:] == (3 * STRIDE, 3, 0, 1)


@pytest.mark.parametrize("start,size", [(4, 128), (0, 96), (0, 32)])
def test_bad_geometry_is_refused(start, size):
    """A start off the 8-byte grid, an area not a power of two or smaller than
    one record: refused, never read past."""
    with pytest.raises(ValueError, match="bad geometry"):
        R.compiled.scan(R.MASKS["logs"], bytearray(size), start, 8, 1, COPY)


# ---- the ring's positions (scan.c's positions and release) ----------------

def test_positions_are_u64_little_endian_at_the_start_of_each_page():
    cons, prod = bytearray(b"\xee" * 64), bytearray(b"\xdd" * 64)
    cons[:8], prod[:8] = struct.pack("<Q", 2**40 + 8), struct.pack("<Q", 2**63 + 16)
    assert R.compiled.positions(cons, prod) == (2**40 + 8, 2**63 + 16)
    assert R.compiled.positions(memoryview(cons), bytes(prod)) == (2**40 + 8, 2**63 + 16)    # read-only: fine


def test_release_stores_u64_little_endian_at_the_start_and_nothing_else():
    cons = bytearray(b"\xee" * 64)
    R.compiled.release(cons, 2**64 - 8)
    assert cons == struct.pack("<Q", 2**64 - 8) + b"\xee" * 56
    R.compiled.release(cons, 0x0102030405060708)
    assert cons[:8] == bytes.fromhex("0807060504030201")
    for bad in (-1, 2**64):
        with pytest.raises(OverflowError):
            R.compiled.release(cons, bad)


@pytest.mark.parametrize("page", [bytes(8), bytearray(4), memoryview(bytearray(16))[1:9], b""])
def test_release_refuses_what_is_not_a_writable_aligned_u64(page):
    with pytest.raises((BufferError, TypeError, ValueError)):
        R.compiled.release(page, 8)


def test_positions_refuse_a_short_or_misaligned_page():
    for page in (bytearray(4), memoryview(bytearray(16))[4:12]):
        with pytest.raises(ValueError, match="aligned uint64"):
            R.compiled.positions(page, bytearray(8))
        with pytest.raises(ValueError, match="aligned uint64"):
            R.compiled.positions(bytearray(8), page)
    with pytest.raises(TypeError):
        R.compiled.positions(bytearray(8))


def test_ring_memory_reads_and_releases_the_kernels_layout():
    """A ring laid out as the kernel maps it (a memfd here): consumer_pos at
    byte 0 of page 0, producer_pos at byte 0 of page 1, the data from page 2.
    read() takes the records up to producer_pos and stores consumer_pos."""
    page, size = mmap.PAGESIZE, 1 << 12
    fd = os.memfd_create("ring")
    try:
        os.ftruncate(fd, 2 * page + size)
        os.pwrite(fd, good(1) + good(2), 2 * page)
        os.pwrite(fd, struct.pack("<Q", 2 * STRIDE), page)
        ring = RingMemory("logs", fd, size)
        assert ring.positions() == (0, 2 * STRIDE)
        batch = ring.read()
        assert batch.records["pid"].tolist() == [1, 2]
        assert os.pread(fd, 16, 0) == struct.pack("<QQ", 2 * STRIDE, 0)
        assert ring.positions() == (2 * STRIDE, 2 * STRIDE) and ring.read() is None
        ring.close()
    finally:
        os.close(fd)
