"""exporter.kernel.maps.PerCpuArray read from many threads at once (scrapes run
in parallel). The kernel's copy is played by a lookup that writes the row
the way bpf_percpu_array_copy does and then lets another thread run, as the
real call does when ctypes releases the GIL around the syscall."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from exporter.kernel import libbpf, maps
from exporter.capture.records import PROBE_COUNTER_FIELDS, PROBE_COUNTERS
from helpers import together

NCPUS = 4


def kernel_rows(index: int) -> np.ndarray:
    """Row index as the test's kernel holds it: every field of CPU c is
    index * 1000 + c (so a row read whole sums to a known value)."""
    dt = np.dtype(PROBE_COUNTERS)
    stride = (dt.itemsize + 7) & ~7
    rows = np.zeros(NCPUS, dtype=np.dtype({"names": ["v"], "formats": [dt], "itemsize": stride}))
    for f in dt.names:
        rows["v"][f] = [index * 1000 + c for c in range(NCPUS)]
    return rows


def fake_lookup(monkeypatch):
    def call(name, fd, key, buf):
        assert name == "bpf_map_lookup_elem"
        data = kernel_rows(int.from_bytes(key, "little")).tobytes()
        ctypes.memmove(buf, data, len(data))
        time.sleep(0.0005)                       # the syscall returns; another scrape runs
        return 0
    monkeypatch.setattr(libbpf, "call", call)


def test_sum_of_one_row(monkeypatch):
    fake_lookup(monkeypatch)
    a = maps.PerCpuArray(3, 4, PROBE_COUNTER_FIELDS, ncpus=NCPUS)
    assert a.sum(2) == {f: 4 * 2000 + 6 for f in np.dtype(PROBE_COUNTERS).names}


def test_sixteen_concurrent_readers_each_get_their_row(monkeypatch):
    # Was one shared buffer: a reader got another reader's row.
    fake_lookup(monkeypatch)
    a = maps.PerCpuArray(3, 4, PROBE_COUNTER_FIELDS, ncpus=NCPUS)

    def scrape(index):
        return [(index, got) for got in (a.sum(index)["calls"] for _ in range(50))
                if got != NCPUS * index * 1000 + 6]
    assert together(16, scrape) == []


def test_compiled_sum_matches_numpy_and_wraps():
    from exporter.kernel import _native
    rng = np.random.default_rng(31)
    for ncpus, words in ((1, 1), (2, 4), (128, 1024)):
        rows = rng.integers(0, 2**64, size=(ncpus, words), dtype=np.uint64, endpoint=False)
        assert _native.percpu_sum(rows.tobytes(), words) == rows.sum(axis=0, dtype=np.uint64).tolist()
    top = np.array([[2**64 - 1], [2]], dtype=np.uint64)           # wraps as the kernel's counters do
    assert _native.percpu_sum(top.tobytes(), 1) == [1]


def test_compiled_sum_refuses_a_partial_value():
    from exporter.kernel import _native
    with pytest.raises(ValueError, match="not whole values of 4"):
        _native.percpu_sum(bytes(40), 4)
    with pytest.raises(ValueError):
        _native.percpu_sum(bytes(8), 0)


def test_counter_fields_are_the_structs_u64s():
    from exporter.capture import records
    assert records.PROBE_COUNTER_FIELDS == tuple(np.dtype(PROBE_COUNTERS).names)
    assert all(np.dtype(PROBE_COUNTERS)[f] == np.uint64 for f in records.PROBE_COUNTER_FIELDS)
    with pytest.raises(TypeError, match="not made of __u64s"):
        records.u64_fields("nettap_hdr")
