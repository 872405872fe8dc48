"""Kernel test of scope node's walk (exporter/kernel/nodewalk.py): where the
kernel offers what the BPF iterator needs (asked of the kernel), the
iterator loads and its rows are the kernel's bpf(2) answer, program for
program, statistics summed over the CPUs included; where it does not, the
walk is bpf(2)'s. Either way nettap leaves no program behind."""
import ctypes
import os

import pytest

from exporter.kernel import _native, bpfstats, libbpf, nodewalk
from exporter.kernel.features import _insn

REPEAT = 1000


def _filter(name: bytes) -> int:
    insns = (ctypes.c_uint64 * 2)(_insn(0xB7), _insn(0x95))        # r0 = 0; exit
    return libbpf.call("bpf_prog_load", libbpf.BPF_PROG_TYPE_SOCKET_FILTER, name, b"GPL", insns, 2, None)


def _run(fd: int, repeat: int) -> None:
    data = ctypes.create_string_buffer(64)
    opts = libbpf.bpf_test_run_opts(sz=ctypes.sizeof(libbpf.bpf_test_run_opts), data_in=ctypes.addressof(data),
                                    data_size_in=len(data), repeat=repeat)
    libbpf.call("bpf_prog_test_run_opts", fd, ctypes.byref(opts))


def test_the_walk_is_the_iterator_where_the_kernel_offers_it():
    offered, why = nodewalk.iterator_offered()
    walk = nodewalk.NodeWalk()
    fd = _filter(b"nodewalk_mark")
    try:
        assert walk.mechanism == "none"                       # nothing loaded before the first walk
        mine = bpfstats.prog_info(fd).id
        got = {p[0]: p for p in walk.programs()}
        assert walk.mechanism == ("iterator" if offered else "bpf(2)"), why
        assert got[mine][1:3] == (b"nodewalk_mark", libbpf.BPF_PROG_TYPE_SOCKET_FILTER)
        if offered:                                           # the iterator lists itself
            assert b"node_programs" in {p[1] for p in got.values()}
    finally:
        walk.close()
        os.close(fd)
    assert b"node_programs" not in {p[1] for p in _native.programs()}     # closed: gone from the kernel


def test_iterator_rows_are_the_kernels_answer():
    offered, why = nodewalk.iterator_offered()
    if not offered:
        pytest.skip(why)
    stats = libbpf.lib().bpf_enable_stats(0)                  # BPF_STATS_RUN_TIME, while this fd is open
    assert stats >= 0, os.strerror(-stats)
    fd = _filter(b"nodewalk_runs")
    it = nodewalk.ProgramIterator(nodewalk.NodeWalk().path)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for cpu in cpus[:2]:                                  # runs on two CPUs: the rows sum them
            os.sched_setaffinity(0, {cpu})
            _run(fd, REPEAT)
        os.sched_setaffinity(0, cpus)
        mine = bpfstats.prog_info(fd).id
        rows = {r[0]: r for r in it.walk()}
        ref = {r[0]: r for r in _native.programs()}
        assert rows[mine][3] == REPEAT * len(cpus[:2]) and rows[mine][4] > 0
        assert rows[mine] == ref[mine]
        both = set(rows) & set(ref)
        assert len(both) >= len(ref) - 2                      # programs may come and go between the walks
        for i in both:                                        # ids, names and types agree; counts only grow
            assert rows[i][:3] == ref[i][:3]
            assert rows[i][3] <= ref[i][3] and rows[i][4] <= ref[i][4]
    finally:
        os.sched_setaffinity(0, cpus)
        it.close()
        os.close(fd)
        os.close(stats)
