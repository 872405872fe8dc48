"""The compiled JSON-lines writer (exporter/capture/writer.c) writes exactly the bytes
of the pure-Python reference (exporter/capture/records.py): on the committed
fixtures, on every UTF-8 case a task name can hold, on IPv6 zero runs and
mapped forms, and on tens of thousands of random records with every field
at its extremes. It must be built: `pip install -e .` (scripts/setup.sh,
which scripts/test.sh runs first) builds it; these tests fail, never skip,
without it."""
from __future__ import annotations

import bisect
import importlib.util
import itertools
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from exporter.capture import records as R
from exporter.kernel import tcp_h
from tests import oracles
from tests.oracles import walk

FIX = Path(__file__).parent / "fixtures" / "records"
_spec = importlib.util.spec_from_file_location("make_fixture", FIX / "make_fixture.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)

KINDS = list(R.DTYPES)                       # every record kind, by its name
U64, U32, U16, U8 = 2**64 - 1, 2**32 - 1, 2**16 - 1, 2**8 - 1
SEED = 20240609


def assert_same(kind: str, recs: np.ndarray) -> None:
    """Both writers, the same bytes; on a difference, show the first line that differs."""
    want = oracles.reference_jsonl(kind, recs)
    got = R.jsonl(kind, recs)
    if got != want:
        for i, (g, w) in enumerate(zip(got.split(b"\n"), want.split(b"\n"))):
            assert g == w, f"record {i}: {recs[i]!r}"
        assert len(got) == len(want)
    assert got.count(b"\n") == len(recs)


def test_compiled_writer_is_built_and_used():
    assert R.compiled.__name__ == "exporter.capture._jsonl"


def test_the_writer_has_an_op_for_every_json_form():
    """The writer's op numbers (exporter/capture/jsonl.h, which records.py reads from
    the module) cover the JSON forms scripts/gen_layout.py gives a field, and no
    other: a new form fails here until the writer writes it."""
    spec = importlib.util.spec_from_file_location("gen_layout", FIX.parents[3] / "scripts" / "gen_layout.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    forms = {f.split(":")[0] for f in gen.FORMS} - {"-", "kind"}     # left out; the "type" literal
    assert set(R.compiled.OPS) == forms | {""}                         # "": a number
    assert len(set(R.compiled.OPS.values()) | {R.compiled.OP_LIT}) == len(R.compiled.OPS) + 1


@pytest.mark.parametrize("kind", KINDS)
def test_fixtures(kind):
    recs, _, _ = walk((FIX / f"{mf.FILES[kind]}.bin").read_bytes(), R.DTYPES[kind])
    golden = (FIX / f"{mf.FILES[kind]}.jsonl").read_bytes()
    assert oracles.reference_jsonl(kind, recs) == golden
    assert R.jsonl(kind, recs) == golden


@pytest.mark.parametrize("kind", KINDS)
def test_empty_batch(kind):
    assert R.jsonl(kind, np.empty(0, R.DTYPES[kind])) == b""


# ---- random records -------------------------------------------------------

def _ints(rng, n: int, bits: int) -> np.ndarray:
    """Mostly extremes and digit-count boundaries, some uniform."""
    top = 2**bits - 1
    edges = sorted({0, 1, 2, top, top - 1, 2**(bits - 1), 2**(bits - 1) - 1,
                    *[10**k for k in range(20) if 10**k <= top],
                    *[10**k - 1 for k in range(1, 21) if 10**k - 1 <= top]})
    pick = rng.choice(np.array(edges, dtype=np.uint64), n)
    uniform = rng.integers(0, top, n, dtype=np.uint64, endpoint=True)
    small = rng.integers(0, 1000, n, dtype=np.uint64)
    which = rng.integers(0, 3, n)
    return np.where(which == 0, pick, np.where(which == 1, uniform, small))


# Pieces of task names: every kind of valid and invalid UTF-8, and every JSON escape.
_PIECES = [
    b"a", b"Z", b"0", b" ", b"~", b"\x7f", b'"', b"\\", b"/", b"\b", b"\f", b"\n", b"\r", b"\t", b"\x01", b"\x1f",
    b"\x0b", b"\x00",                                           # NUL: the name ends there
    "\u00e9".encode(), "\u07ff".encode(), "\u0800".encode(), "\u2028".encode(), "\uffff".encode(),
    "\ufffd".encode(), "\U00010000".encode(), "\U0001F600".encode(), "\U0010FFFF".encode(),
    b"\x80", b"\xbf", b"\xc0", b"\xc1", b"\xc2", b"\xdf", b"\xe0", b"\xed", b"\xef", b"\xf0", b"\xf4",
    b"\xf5", b"\xf8", b"\xfe", b"\xff",                        # lone and never-valid bytes
    b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xe0\x9f\xbf", b"\xf0\x80\x80\xaf", b"\xf0\x8f\xbf\xbf",  # overlongs
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\x9f\xbf",         # surrogates, and the last code point before
    b"\xf4\x90\x80\x80", b"\xf4\x8f\xbf\xbf",                  # above U+10FFFF, and U+10FFFF
    b"\xe2\x82", b"\xf0\x9f\x98", b"\xf0\x9f", b"\xc3",         # truncated
    b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\xf0\x90\x28\xbc",  # bad continuation in the middle
]


def _comm(rng) -> bytes:
    out = b""
    while len(out) < 16 and rng.random() < 0.85:
        out += _PIECES[rng.integers(len(_PIECES))] if rng.random() < 0.7 else bytes([rng.integers(256)])
    return out[:16]                                             # may cut a sequence at the end


def _addr(rng, family: int) -> bytes:
    if family != socket.AF_INET6 or rng.random() < 0.2:
        return rng.bytes(16)
    words = [0 if rng.random() < 0.5 else int(rng.choice([1, 0xffff, rng.integers(1, 0x10000)])) for _ in range(8)]
    form = rng.integers(6)
    if form == 0:                                               # ::ffff:a.b.c.d
        words[:6] = [0, 0, 0, 0, 0, 0xffff]
    elif form == 1:                                             # ::a.b.c.d
        words[:6] = [0] * 6
    return b"".join(w.to_bytes(2, "big") for w in words)


def _fields(kind: str) -> dict:
    """name -> (bytes, JSON form) of a kind's record, from the generated field table."""
    return {f[0]: (f[4], f[5]) for f in tcp_h.STRUCTS[tcp_h.RECORDS[R.kind_of(kind)][1]][1]}


def random_records(kind: str, n: int, seed: int) -> np.ndarray:
    """n records of a kind (or of a ring's one kind), each field drawn by its C type and JSON
    form (so a new kind is covered as it is defined): integers at their
    extremes and digit boundaries, names inside and outside their tables,
    every flag bit, payload lengths up to and past the array, every family
    and IPv6 form, task names of every UTF-8 and escape case."""
    rng = np.random.default_rng(seed)
    dt = R.DTYPES[R.kind_of(kind)]
    recs = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=dt).copy()   # every byte random to start
    fields = _fields(kind)
    for name, (size, form) in fields.items():            # integers first: other fields read them
        if form.startswith(("enum:", "flags:")):
            names = R.names_of(form)
            inside = rng.integers(0, max(names) + 3, n) if form.startswith("enum:") else rng.integers(0, 256, n)
            recs[name] = np.where(rng.random(n) < 0.7, inside, _ints(rng, n, 8 * size)).astype(dt.fields[name][0])
        elif form == "family":
            recs[name] = rng.choice(np.array([2, 10, 2, 10, 0, 1, 3, 11, 10, U16], dtype=np.uint16), n)
        elif dt.fields[name][0].kind == "u":
            recs[name] = _ints(rng, n, 8 * size).astype(dt.fields[name][0])
    for name, (size, form) in fields.items():
        if form == "addr":
            raw = b"".join(_addr(rng, int(f)) for f in recs["family"])
            recs[name] = np.frombuffer(raw, dtype="S16")
        elif form == "text":
            raw = b"".join(_comm(rng).ljust(size, b"\0") for _ in range(n))
            recs[name] = np.frombuffer(raw, dtype=f"S{size}")
            assert recs.view(np.uint8).reshape(n, -1)[:, dt.fields[name][1]:][:, :size].tobytes() == raw
        elif form.startswith("base64:"):
            length = form.split(":", 1)[1]
            inside = rng.integers(0, size + 1, n, dtype=np.uint64)
            over = rng.choice(np.array([size + 1, size + 2, size + 3, size + 4, 65536, U32], dtype=np.uint64), n)
            recs[length] = np.where(rng.random(n) < 0.8, inside, over)
    return recs


@pytest.mark.parametrize("kind", KINDS)
def test_random_records(kind):
    recs = random_records(kind, 20000, SEED + KINDS.index(kind))
    assert_same(kind, recs)
    for name, (size, form) in _fields(kind).items():     # what the draw must have met
        if form.startswith("flags:") and size == 1:
            assert len(set(recs[name].tolist())) == 256, name
        if form.startswith("enum:"):
            values = set(recs[name].tolist())
            assert values & set(R.names_of(form)) and values - set(R.names_of(form)), name
        if form.startswith("base64:"):
            n = recs[form.split(":", 1)[1]]
            assert (n > size).any() and (n == 0).any() and (n == size).any(), name


@pytest.mark.parametrize("kind", KINDS)
def test_line_bounds_hold(kind):
    """The pipeline bounds its queue by records.LINE_MAX before formatting:
    no line the sink writes of the randomised extremes is longer (the
    compiled writer's, which test_random_records holds byte-equal to the
    reference writer's; ~0.2 s a kind where the reference took ~3), and the
    compiled writer's own worst case (what it reserves per record) is within
    it too."""
    recs = random_records(kind, 20000, SEED + 11)
    written = R.jsonl(kind, recs)
    assert written.count(b"\n") == len(recs)
    longest = max(len(line) + 1 for line in written.split(b"\n")[:-1])
    assert longest <= R.LINE_MAX[tcp_h.RECORDS[kind][0]]
    assert R.compiled.line_max(R.NUMBERS[kind]) <= R.LINE_MAX[tcp_h.RECORDS[kind][0]]


@pytest.mark.parametrize("kind", KINDS)
def test_strided_and_reversed_views(kind):
    """The kind reader hands out a field view of kind slots (stride 512 for 504-byte chunks)."""
    recs = random_records(kind, 2000, SEED + 7)
    slots = np.zeros(len(recs), R.slot_dtype(R.DTYPES[kind]))
    slots["rec"] = recs
    view = slots["rec"]
    assert view.strides[0] == R.slot_dtype(R.DTYPES[kind]).itemsize
    assert R.jsonl(kind, view) == oracles.reference_jsonl(kind, recs)
    assert R.jsonl(kind, recs[::-1]) == oracles.reference_jsonl(kind, recs[::-1].copy())
    assert R.jsonl(kind, recs[::3]) == oracles.reference_jsonl(kind, recs[::3].copy())


# ---- task names: every UTF-8 case, exhaustively where it is cheap ---------

def _eofs_with_comms(comms) -> np.ndarray:
    recs = np.zeros(len(comms), R.EOF_)
    recs["family"] = socket.AF_INET
    recs["comm"] = np.frombuffer(b"".join(c.ljust(16, b"\0") for c in comms), dtype="S16")
    return recs


def test_every_two_byte_name():
    comms = [bytes([a, b]) for a in range(256) for b in range(256)]
    assert_same("capture_eof", _eofs_with_comms(comms))
    # the same at the end of a 16-byte name (no NUL after it), and followed by text
    assert_same("capture_eof", _eofs_with_comms([b"x" * 14 + c for c in comms]))
    assert_same("capture_eof", _eofs_with_comms([c + b"z" for c in comms]))


_EDGES = [0x01, 0x09, 0x1f, 0x20, 0x22, 0x41, 0x5c, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
          0xc2, 0xdf, 0xe0, 0xe1, 0xec, 0xed, 0xee, 0xef, 0xf0, 0xf1, 0xf3, 0xf4, 0xf5, 0xff]


def test_every_three_byte_name_over_the_boundary_bytes():
    comms = [bytes(t) for t in itertools.product(_EDGES, repeat=3)]
    assert_same("capture_eof", _eofs_with_comms(comms))
    assert_same("capture_eof", _eofs_with_comms([b"y" * 13 + c for c in comms]))


def test_every_four_byte_name_over_lead_and_continuation_bytes():
    edges = [0x41, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc2, 0xe0, 0xed, 0xef, 0xf0, 0xf4, 0xf5]
    comms = [bytes(t) for t in itertools.product(edges, repeat=4)]
    assert_same("capture_eof", _eofs_with_comms(comms))
    assert_same("capture_eof", _eofs_with_comms([b"w" * 12 + c for c in comms]))


def test_name_output_is_pythons_replace_decoding():
    # Independent of the reference writer: the compiled writer against str.decode + json.dumps.
    import json
    comms = [b"a\xed\xa0\x80b", b"\xf0\x9f\x98", b"\xe0\x80\xaf", b"a\x00\xff", b"\x01\x1f\x7f\"\\",
             b"\xf4\x90\x80\x80", b"\xc3\xa9\xe2\x82", b"0123456789abcdef"]
    out = R.jsonl("capture_eof", _eofs_with_comms(comms)).decode("utf-8").splitlines()
    for c, line in zip(comms, out):
        want = json.dumps(c.split(b"\0")[0].decode("utf-8", "replace"), ensure_ascii=False)
        assert line.startswith('{"comm":' + want + ',"conn_id":')


# ---- addresses --------------------------------------------------------------

def _eofs_with_addrs(family: int, addrs) -> np.ndarray:
    recs = np.zeros(len(addrs), R.EOF_)
    recs["family"] = family
    recs["saddr"] = np.frombuffer(b"".join(addrs), dtype="S16")
    recs["daddr"] = np.frombuffer(b"".join(addrs[::-1]), dtype="S16")
    return recs


def test_every_ipv6_zero_run_and_mapped_form():
    rng = np.random.default_rng(SEED)
    addrs = []
    for mask in range(256):                                     # which of the 8 groups are zero
        for value in (1, 0xffff, 0xabc, None):
            words = [0 if mask >> i & 1 else (value or int(rng.integers(1, 0x10000))) for i in range(8)]
            addrs.append(b"".join(w.to_bytes(2, "big") for w in words))
    for w5 in (0, 1, 0xfffe, 0xffff):                           # ::a.b.c.d, ::ffff:a.b.c.d and near misses
        for tail in (b"\0\0\0\0", b"\0\0\0\1", b"\1\2\3\4", b"\xff\xff\xff\xff", b"\0\1\0\0", b"\x0a\0\0\x09"):
            for w4 in (0, 1):
                addrs.append(b"\0" * 8 + w4.to_bytes(2, "big") + w5.to_bytes(2, "big") + tail)
    recs = _eofs_with_addrs(socket.AF_INET6, addrs)
    assert_same("capture_eof", recs)
    # and independently of the reference: socket.inet_ntop itself
    import json
    for a, line in zip(addrs, R.jsonl("capture_eof", recs).decode().splitlines()):
        assert json.loads(line)["saddr"] == socket.inet_ntop(socket.AF_INET6, a)


def test_ipv4_and_unknown_family_addresses():
    octets = [0, 1, 9, 10, 99, 100, 199, 200, 255]
    addrs = [bytes(t) + b"\x11" * 12 for t in itertools.product(octets, repeat=4)]
    assert_same("capture_eof", _eofs_with_addrs(socket.AF_INET, addrs))
    for fam in (0, 1, 3, 11, 12345, U16):
        assert_same("capture_eof", _eofs_with_addrs(fam, addrs[:50] + [b"\0" * 16, b"\xff" * 16]))


# ---- the interpreter lock ---------------------------------------------------

def test_formatting_releases_the_interpreter_lock():
    """While a big batch is formatted, another Python thread keeps running
    (the ring-drain thread must never be starved by the sink)."""
    recs = random_records("capture_chunks", 2000, SEED + 11)
    recs["len"] = R.CHUNK_DATA
    recs = np.tile(recs, 25)                                    # 50,000 full chunks: tens of ms
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    try:
        for _ in range(5):                                      # a noisy machine may not schedule it once
            time.sleep(0.01)
            t0 = time.perf_counter()
            R.jsonl("capture_chunks", recs)
            t1 = time.perf_counter()
            lo, hi = t0 + 0.2 * (t1 - t0), t0 + 0.8 * (t1 - t0)
            # ticks is sorted (one thread appends perf_counter()): the first
            # tick after lo, found by bisection; a running ticker appends
            # hundreds of thousands while a batch is formatted, so a look at
            # only the last ones missed the window and failed the test.
            i = bisect.bisect_right(ticks, lo)
            if i < len(ticks) and ticks[i] < hi:
                return
        pytest.fail("no other thread ran while the batch was formatted: the GIL is held")
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("bad", [
    lambda t: (t[0], t[1], [None, (32, [(b'{"a":', 1, 28, 8, 0, 0)])], t[3]),    # past the record's end
    lambda t: (t[0], t[1], [None, (32, [(b'{"a":', 3, 24, 16, 0, 0)])], t[3]),   # an address of 16 in 8 bytes
    lambda t: (t[0], t[1], [None, (32, [(b'{"a":', 5, 0, 1, 99, 0)])], t[3]),    # no enum table 99
    lambda t: (t[0], t[1], [None, (32, [(b'{"a":', 1, 0, 3, 0, 0)])], t[3]),     # a 3-byte integer
    lambda t: (t[0], t[1], [None, (32, [(b"x" * 40, 1, 0, 8, 0, 0)])], t[3]),    # text past PREFIX_MAX
    lambda t: (t[0], [[(3, b'"two bits"')]], t[2], t[3]),                        # a flag of two bits
    lambda t: (t[0], t[1], [None, (16, [(b'{"a":', 1, 0, 8, 0, 0)])], t[3]),     # too short for the header
    lambda t: (t[0], t[1], t[2], (16, 3)),                                       # a kind of 3 bytes
])
def test_init_refuses_tables_it_cannot_keep_to(bad):
    """The writer checks every row against its record before it formats
    one: a table that would read past a record or a name table is refused,
    and nothing is formatted until a good one is given."""
    good = R._writer_tables()
    try:
        with pytest.raises(ValueError):
            R.compiled.init(*bad(good))
        with pytest.raises((RuntimeError, ValueError)):
            R.compiled.format(R.KINDS["capture_chunks"], np.zeros(1, R.RECORDS["capture_chunks"]))
    finally:
        R.compiled.init(*good)
    assert R.jsonl("logs", np.zeros(1, R.LOG)).startswith(b'{"arg0":0,')
    with pytest.raises(ValueError, match="unknown record kind 0"):      # no kind is 0
        R.compiled.format(0, np.zeros(1, R.LOG))
