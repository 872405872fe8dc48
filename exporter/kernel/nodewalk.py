"""The node's BPF programs for bpfStats scope node: by a BPF iterator
(bpf/node.bpf.c) where the kernel runs it, else by bpf(2).

Asked of bpf(2), every program costs four calls a scrape (next id, fd by id,
info, close: exporter/kernel/_native.c makes them without the interpreter
lock), ~5 µs a program here. The iterator answers for every program in one
read(2): a row a program (bpf/node.h), its statistics summed over the CPUs
in the kernel. It needs Linux 5.19 (bpf_map_lookup_percpu_elem), and is
loaded the first time a scrape asks for the node's programs, so a nettap in
scope own never loads it. Its link is held by fd and pinned nowhere: it
goes with nettap, and :meth:`NodeWalk.close` lets it go before.

Each walk gives (id, name, type, run_cnt, run_time_ns), name as the kernel
keeps it (16 bytes at most; bpfstats.node_programs reads full names).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from typing import List, Optional, Tuple

from exporter.kernel import _native, arch, features, libbpf

log = logging.getLogger(__name__)

OBJECT = "node.bpf.o"
PROGRAM = b"node_programs"
ROW = struct.Struct("=IIQQ16s")     # struct nettap_node_prog (bpf/node.h)

BPF_FUNC_map_lookup_percpu_elem = 195     # include/uapi/linux/bpf.h, Linux 5.19

Program = Tuple[int, bytes, int, int, int]


def iterator_offered() -> Tuple[bool, str]:
    """Does the kernel have what the iterator needs? (iter/bpf_prog came in
    5.10, bpf_map_lookup_percpu_elem in 5.19: asked of the kernel, so a
    refused load does not print its verifier log.)"""
    ok, how = features.helper(features.BPF_PROG_TYPE_TRACEPOINT, BPF_FUNC_map_lookup_percpu_elem)
    return ok, "" if ok else f"the kernel has no bpf_map_lookup_percpu_elem (Linux 5.19; {how})"


def parse(rows: bytes) -> List[Program]:
    """The iterator's rows as (id, name, type, run_cnt, run_time_ns)."""
    if len(rows) % ROW.size:
        raise ValueError(f"node iterator: {len(rows)} bytes is not a whole number of {ROW.size}-byte rows")
    return [(i, name.split(b"\0", 1)[0], t, cnt, ns) for i, t, cnt, ns, name in ROW.iter_unpack(rows)]


class ProgramIterator:
    """bpf/<arch>/node.bpf.o loaded and its iterator attached; :meth:`walk` reads it."""

    def __init__(self, path: str):
        lb = libbpf.lib()
        self.obj = libbpf.call_ptr("bpf_object__open_file", path.encode(), None)
        self.link = None
        try:
            libbpf.call("bpf_object__load", self.obj)
            prog = libbpf.call_ptr("bpf_object__find_program_by_name", self.obj, PROGRAM)
            self.link = libbpf.call_ptr("bpf_program__attach_iter", prog, None)
            self.link_fd = lb.bpf_link__fd(self.link)
        except BaseException:
            self.close()
            raise

    def walk(self) -> List[Program]:
        fd = libbpf.call("bpf_iter_create", self.link_fd)
        try:
            parts = []
            while True:
                b = os.read(fd, 1 << 16)
                if not b:
                    break
                parts.append(b)
        finally:
            os.close(fd)
        return parse(b"".join(parts))

    def close(self) -> None:
        if self.link:
            libbpf.lib().bpf_link__destroy(self.link)
            self.link = None
        if self.obj:
            libbpf.lib().bpf_object__close(self.obj)
            self.obj = None


class NodeWalk:
    """The node's programs, by the iterator once it loads, else by bpf(2).
    Loaded at the first walk; a refusal is said once (info: the bpf(2) walk
    answers the same) and not tried again."""

    def __init__(self, bpf_dir: Optional[str] = None):
        self.path = arch.object_path(OBJECT, bpf_dir=bpf_dir)
        self._iter: Optional[ProgramIterator] = None
        self._refused: Optional[str] = None
        self._lock = threading.Lock()

    @property
    def mechanism(self) -> str:
        """iterator or bpf(2): how the last walk was made (none before one)."""
        if self._iter is not None:
            return "iterator"
        return "bpf(2)" if self._refused else "none"

    def _iterator(self) -> Optional[ProgramIterator]:
        with self._lock:
            if self._iter is None and self._refused is None:
                offered, why = iterator_offered()
                try:
                    if not offered:
                        raise OSError(why)
                    self._iter = ProgramIterator(self.path)
                except OSError as e:
                    self._refused = e.strerror or str(e)
                    log.info("scope node: the BPF program iterator is refused (%s); walking by bpf(2)",
                             self._refused)
            return self._iter

    def programs(self) -> List[Program]:
        it = self._iterator()
        if it is not None:
            try:
                return it.walk()
            except (OSError, ValueError) as e:      # a link that fails later: the bpf(2) walk from now on
                with self._lock:                    # one scrape of those that failed at once closes it
                    mine = self._iter is it
                    if mine:
                        self._iter, self._refused = None, str(e)
                if mine:
                    log.warning("scope node: the BPF program iterator failed (%s); walking by bpf(2)", e)
                    it.close()
        return _native.programs()

    def close(self) -> None:
        with self._lock:
            it, self._iter = self._iter, None
        if it is not None:
            it.close()
