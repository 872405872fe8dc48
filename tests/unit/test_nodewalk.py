"""exporter.kernel.nodewalk without a kernel: the iterator's rows parsed, and
a walk that falls back to bpf(2) when the kernel refuses the iterator, or
when its link fails later (closed once, whichever scrapes saw it fail)."""
from __future__ import annotations

import logging
import threading

import pytest

from exporter.kernel import nodewalk

BPF2 = [(7, b"bpf2_walk", 1, 0, 0)]


def test_rows_are_parsed_and_garbage_refused():
    rows = nodewalk.ROW.pack(5, 26, 10, 2000, b"node_programs") + nodewalk.ROW.pack(9, 1, 0, 0, b"x" * 16)
    assert nodewalk.parse(rows) == [(5, b"node_programs", 26, 10, 2000), (9, b"x" * 16, 1, 0, 0)]
    with pytest.raises(ValueError):
        nodewalk.parse(rows[:-1])


class FakeIterator:
    def __init__(self, fail=False):
        self.fail, self.closed, self.walks = fail, 0, 0
        self.gate = threading.Barrier(2)

    def walk(self):
        self.walks += 1
        if self.fail:
            self.gate.wait(5)                 # both scrapes inside the failing walk at once
            raise OSError(9, "Bad file descriptor")
        return [(1, b"node_programs", 26, 0, 0)]

    def close(self):
        self.closed += 1


@pytest.fixture
def walk(monkeypatch):
    monkeypatch.setattr(nodewalk._native, "programs", lambda: list(BPF2))
    monkeypatch.setattr(nodewalk, "iterator_offered", lambda: (True, ""))
    return nodewalk.NodeWalk("/nonexistent")


def test_refused_iterator_falls_back_to_bpf2_and_says_so_once(walk, monkeypatch, caplog):
    monkeypatch.setattr(nodewalk, "iterator_offered", lambda: (False, "no bpf_map_lookup_percpu_elem"))
    with caplog.at_level(logging.INFO, logger="exporter.kernel.nodewalk"):
        assert walk.programs() == BPF2 and walk.programs() == BPF2
    assert walk.mechanism == "bpf(2)"
    assert [r.getMessage() for r in caplog.records].count(
        "scope node: the BPF program iterator is refused (no bpf_map_lookup_percpu_elem); walking by bpf(2)") == 1


def test_a_failing_link_is_closed_once_and_bpf2_answers(walk, monkeypatch):
    it = FakeIterator(fail=True)
    monkeypatch.setattr(nodewalk, "ProgramIterator", lambda path: it)
    out = []
    threads = [threading.Thread(target=lambda: out.append(walk.programs())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == [BPF2, BPF2] and it.walks == 2 and it.closed == 1
    assert walk.mechanism == "bpf(2)" and walk.programs() == BPF2 and it.walks == 2


def test_the_iterator_answers_once_loaded(walk, monkeypatch):
    it = FakeIterator()
    monkeypatch.setattr(nodewalk, "ProgramIterator", lambda path: it)
    assert walk.programs() == [(1, b"node_programs", 26, 0, 0)] and walk.mechanism == "iterator"
    walk.close()
    assert it.closed == 1 and walk.mechanism == "none"
