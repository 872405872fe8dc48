"""Kernel BPF run-time statistics: the switch, and reading them.

The switch (``diagnostics.bpfStats.enabled``) holds a ``BPF_ENABLE_STATS``
fd while statistics are wanted: the kernel counts run time for as long as
any such fd is open, and stops by itself when nettap dies, even by kill -9.
Only where the fd is refused does nettap write ``kernel.bpf_stats_enabled``
instead, and it writes it back to 0 only if it was nettap that set it; a
sysctl someone else switched on is never switched off.

Whether statistics are on: ``kernel.bpf_stats_enabled`` shows only what was
written to it (kernel/bpf/syscall.c, bpf_stats_handler, keeps its own
saved_val), not the BPF_ENABLE_STATS fds other processes hold (another
nettap on the node); the static key they all count under is not visible.
:class:`KernelStatsProbe` asks the key itself: it runs a two-instruction
program once with BPF_PROG_TEST_RUN, whose run is counted (bpf_prog_run)
only while the key is on.

Reading: nettap's own programs with one ``BPF_OBJ_GET_INFO_BY_FD`` each on
the fds it holds (no walk of the node's programs). The node-wide view
(``scope: node``) walks every program by a BPF iterator where the kernel
runs it (exporter/kernel/nodewalk.py), else with ``BPF_PROG_GET_NEXT_ID``
and ``BPF_OBJ_GET_INFO_BY_FD`` in one compiled call. Programs are named as
``bpftool prog show`` names them: by the full name of their first function
in their BTF where the kernel's 15-character name is cut short, so
node-scope names are those of the own-scope series (libbpf's program
names). The full names are resolved once per program id. The
collector of both views is exporter/metrics/programs.py.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable, Dict, List, Optional, Tuple

from exporter.kernel import _native, libbpf

log = logging.getLogger(__name__)

SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"
BPF_OBJ_NAME_LEN = 16           # include/uapi/linux/bpf.h: bpf_prog_info.name, NUL included


class bpf_prog_info(ctypes.Structure):
    """``struct bpf_prog_info`` (uapi/linux/bpf.h) up to the run statistics;
    the kernel fills what fits in the length we pass."""

    _fields_ = [
        ("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
        ("_pad1", ctypes.c_uint8 * 48),                 # jited/xlated lengths .. map_ids
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),     # offset 64
        ("_pad2", ctypes.c_uint8 * 48),                 # ifindex .. jited_func_lens
        ("btf_id", ctypes.c_uint32),                    # offset 128
        ("func_info_rec_size", ctypes.c_uint32),        # offset 132
        ("func_info", ctypes.c_uint64),                 # offset 136: struct bpf_func_info *
        ("nr_func_info", ctypes.c_uint32),              # offset 144
        ("_pad3", ctypes.c_uint8 * 44),                 # nr_line_info .. prog_tags
        ("run_time_ns", ctypes.c_uint64),               # offset 192
        ("run_cnt", ctypes.c_uint64),                   # offset 200
        ("recursion_misses", ctypes.c_uint64),          # offset 208 (Linux 5.12; 0 before)
    ]


assert bpf_prog_info.name.offset == 64 and bpf_prog_info.run_time_ns.offset == 192
assert bpf_prog_info.btf_id.offset == 128 and bpf_prog_info.nr_func_info.offset == 144


class bpf_func_info(ctypes.Structure):
    """``struct bpf_func_info { __u32 insn_off; __u32 type_id; }`` (uapi/linux/bpf.h)."""

    _fields_ = [("insn_off", ctypes.c_uint32), ("type_id", ctypes.c_uint32)]


class btf_type(ctypes.Structure):
    """The head of ``struct btf_type`` (uapi/linux/btf.h): ``__u32 name_off;
    __u32 info;`` with the kind in bits 24-28 of info."""

    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32)]


class KernelStatsProbe:
    """Are the kernel's BPF run-time statistics on, by anyone's doing?
    Load (needs CAP_BPF) before privileges are dropped; :meth:`on` needs
    none. Thread-safe."""

    def __init__(self):
        self.fd: Optional[int] = None
        self._lock = threading.Lock()
        self._data = ctypes.create_string_buffer(64)      # a packet: at least ETH_HLEN bytes

    def load(self) -> bool:
        """Load the probe program (r0 = 0; exit) once; False if refused."""
        with self._lock:
            if self.fd is None:
                from exporter.kernel.features import _insn
                insns = (ctypes.c_uint64 * 2)(_insn(0xB7), _insn(0x95))
                fd = libbpf.lib().bpf_prog_load(libbpf.BPF_PROG_TYPE_SOCKET_FILTER, b"nettap_stats_on",
                                                b"GPL", insns, 2, None)
                if fd < 0:
                    log.debug("BPF statistics probe not loaded: %s", os.strerror(-fd))
                    return False
                self.fd = fd
            return True

    def on(self) -> Optional[bool]:
        """True while statistics are on, False while off, None if unknown
        (the probe cannot be loaded or run)."""
        if self.fd is None and not self.load():
            return None
        with self._lock:
            before = prog_info(self.fd).run_cnt
            opts = libbpf.bpf_test_run_opts(sz=ctypes.sizeof(libbpf.bpf_test_run_opts),
                                             data_in=ctypes.addressof(self._data),
                                             data_size_in=len(self._data), repeat=1)
            if libbpf.lib().bpf_prog_test_run_opts(self.fd, ctypes.byref(opts)) != 0:
                return None
            return prog_info(self.fd).run_cnt != before

    def close(self) -> None:
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


# The process's one probe: the CLI loads it before dropping privileges.
STATE_PROBE = KernelStatsProbe()


class StatsSwitch:
    """Turns kernel BPF statistics on and off. Thread-safe."""

    def __init__(self, sysctl: str = SYSCTL,
                 enable_stats: Optional[Callable[[], int]] = None,
                 kernel_on: Optional[Callable[[], Optional[bool]]] = None):
        """kernel_on: whether statistics are on in the kernel by anyone's
        doing (True/False; None: unknown, then the sysctl is read), as
        :meth:`KernelStatsProbe.on` answers."""
        self.sysctl = sysctl
        self.kernel_on = kernel_on or (lambda: None)
        self._enable_stats = enable_stats or (lambda: libbpf.call("bpf_enable_stats", libbpf.BPF_STATS_RUN_TIME))
        self._lock = threading.Lock()
        self.fd: Optional[int] = None
        self.set_sysctl = False      # nettap wrote 1 to the sysctl
        self.requested = False       # the config asks for statistics

    def _sysctl_on(self) -> bool:
        try:
            with open(self.sysctl) as f:
                return f.read().strip() == "1"
        except OSError:
            return False

    def set(self, on: bool) -> None:
        with self._lock:
            if on:
                self._on()
            else:
                self._off()

    def _on(self) -> None:
        self.requested = True
        if self.fd is not None or self.set_sysctl:
            return
        try:
            self.fd = self._enable_stats()
            log.info("BPF run-time statistics on (BPF_ENABLE_STATS fd)")
            return
        except OSError as e:
            log.warning("BPF_ENABLE_STATS refused (%s); falling back to %s", e, self.sysctl)
        if self._sysctl_on():
            log.info("BPF run-time statistics already on (switched on by another tool)")
            return
        with open(self.sysctl, "w") as f:
            f.write("1")
        self.set_sysctl = True
        log.info("BPF run-time statistics on (%s=1)", self.sysctl)

    def _off(self) -> None:
        self.requested = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            log.info("BPF run-time statistics: released the BPF_ENABLE_STATS fd")
        if self.set_sysctl:
            try:
                with open(self.sysctl, "w") as f:
                    f.write("0")
            except OSError as e:
                log.error("cannot switch %s back off: %s", self.sysctl, e)
            self.set_sysctl = False
            log.info("BPF run-time statistics: %s set back to 0", self.sysctl)

    @property
    def wanted(self) -> bool:
        """The config asks for statistics (they may be on by another tool's doing)."""
        return self.requested

    def source(self) -> Optional[str]:
        """How stats are on now: fd or sysctl (this nettap holds them on),
        external (another process does: its own BPF_ENABLE_STATS fd, e.g.
        another nettap, or the sysctl), or None (off)."""
        if self.fd is not None:
            return "fd"
        if self.set_sysctl:
            return "sysctl"
        on = self.kernel_on()
        if on is None:
            on = self._sysctl_on()
        return "external" if on else None

    def close(self) -> None:
        self.set(False)


def prog_info(fd: int) -> bpf_prog_info:
    info = bpf_prog_info()
    n = ctypes.c_uint32(ctypes.sizeof(info))
    libbpf.call("bpf_obj_get_info_by_fd", fd, ctypes.byref(info), ctypes.byref(n))
    return info


def own_programs(prog_fds: Dict[str, int]) -> Dict[str, Tuple[int, int, int]]:
    """{program: (run_cnt, run_time_ns, recursion_misses)} for nettap's
    programs: one BPF_OBJ_GET_INFO_BY_FD each on the fds nettap holds, no
    walk, in one call into the compiled module. recursion_misses: runs the
    kernel skipped because the program was already running on that CPU
    (recursion, or preemption on PREEMPT_RT), counted whether statistics
    are on or not."""
    names = list(prog_fds)
    return dict(zip(names, _native.prog_stats([prog_fds[n] for n in names])))


def own_program_stats(prog_fds: Dict[str, int]) -> Dict[str, Tuple[int, int]]:
    """{program: (run_cnt, run_time_ns)} (own_programs)."""
    return {name: (cnt, ns) for name, (cnt, ns, _) in own_programs(prog_fds).items()}


def prog_full_name(fd: int, info: bpf_prog_info) -> bytes:
    """The program's full name, the way ``bpftool prog show`` finds it
    (get_prog_full_name, bpftool's src/common.c): the kernel keeps 15
    characters of the name, the program's BTF has its first function's whole
    name. info is the program's BPF_OBJ_GET_INFO_BY_FD answer (btf_id and
    nr_func_info read). A second info call fetches func_info[0], then the
    BTF is loaded by id (BPF_BTF_GET_FD_BY_ID and a read of the whole
    BTF): costly, so callers cache the answer by program id.

    The kernel's name where it is shorter than 15 characters (not cut), or
    the program has no BTF or func_info, or any of this fails."""
    name = info.name
    if len(name) < BPF_OBJ_NAME_LEN - 1 or not info.btf_id or not info.nr_func_info:
        return name
    lb = libbpf.lib()
    finfo = bpf_func_info()
    req = bpf_prog_info()
    req.nr_func_info = 1
    req.func_info_rec_size = min(info.func_info_rec_size, ctypes.sizeof(finfo))
    req.func_info = ctypes.addressof(finfo)
    n = ctypes.c_uint32(ctypes.sizeof(req))
    if lb.bpf_obj_get_info_by_fd(fd, ctypes.byref(req), ctypes.byref(n)) != 0:
        return name
    btf = lb.btf__load_from_kernel_by_id(req.btf_id)
    if not btf:
        return name
    try:
        t = lb.btf__type_by_id(btf, finfo.type_id)
        if not t:
            return name
        t = btf_type.from_address(t)
        if (t.info >> 24) & 0x1f != libbpf.BTF_KIND_FUNC:
            return name
        return lb.btf__name_by_offset(btf, t.name_off) or name     # bytes, copied before the free
    finally:
        lb.btf__free(btf)


_FULL_NAMES: Dict[int, bytes] = {}       # program id -> full name, for node_programs
_WALK_REFUSED: list = []                 # the walk's first refusal, logged once


def _full_name_by_id(prog_id: int, short: bytes) -> bytes:
    """prog_full_name for a program known by id (its kernel name: short)."""
    if len(short) < BPF_OBJ_NAME_LEN - 1:
        return short
    fd = libbpf.lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:                           # unloaded since
        return short
    try:
        return prog_full_name(fd, prog_info(fd))
    except OSError:
        return short
    finally:
        os.close(fd)


def node_programs(full_names: Optional[Dict[int, bytes]] = None,
                  walk: Optional[Callable[[], list]] = None) -> List[Tuple[int, bytes, int, int, int]]:
    """(id, name, type, run_cnt, run_time_ns) of every program on the node.

    walk: what lists them with their kernel names (nodewalk.NodeWalk's
    programs: the BPF iterator where the kernel runs it); by default one
    call into the compiled module (exporter/kernel/_native.c, ``programs``):
    four bpf(2) calls a program (next id, fd by id, info, close), without
    the interpreter lock. A program unloaded during the walk, or whose info
    cannot be read, is left out; a walk the kernel refuses (no
    CAP_SYS_ADMIN) gives none.

    Names are full names (prog_full_name), cached by program id in
    full_names (by default the process's one cache, _FULL_NAMES): a
    program's name never changes and its id is not handed out again (ids
    cycle up to INT_MAX), so each program's BTF is read once. Ids no longer
    loaded are dropped from the cache."""
    names = _FULL_NAMES if full_names is None else full_names
    try:
        walked = (walk or _native.programs)()
    except OSError as e:                 # the walk refused (no CAP_SYS_ADMIN): no node view, said once
        if not _WALK_REFUSED:
            _WALK_REFUSED.append(e)
            log.warning("scope node: cannot walk the node's BPF programs: %s (it needs CAP_SYS_ADMIN)",
                        e.strerror or e)
        return []
    out = []
    for prog_id, short, ptype, cnt, ns in walked:
        name = names.get(prog_id)
        if name is None:
            name = names[prog_id] = _full_name_by_id(prog_id, short)
        out.append((prog_id, name, ptype, cnt, ns))
    if len(names) > len(out):            # programs unloaded: forget them
        live = {p[0] for p in out}
        for pid_ in list(names):         # list(): a copy taken at once (scrapes may overlap)
            if pid_ not in live:
                names.pop(pid_, None)
    return out
