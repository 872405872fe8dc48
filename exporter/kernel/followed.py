"""What the TIME_WAIT and request programs follow (bpf/timewait.bpf.c,
bpf/request.bpf.c), forgotten as a reload detaches them (capture.records no
longer asks for ``timewait`` or ``request`` records). No program is left to
end those entries: kept, they would stay counted alive for ever and, should
the programs come back, be taken for the new sockets the kernel makes in
their memory. So the loader empties their maps and zeroes their counts (the
variables' offsets from the object's symbol table) once no detached
program can still be running (an RCU grace period), and counts
what it forgot: ``nettap_tcp_timewait_sockets_ended_total{cause="forgotten"}``
and ``nettap_tcp_request_sockets_total{outcome="forgotten"}`` (bpf/tcp.h
NETTAP_TW_FORGOTTEN, NETTAP_REQ_FORGOTTEN: rows of obs_counters no program
writes, added by exporter/commands/daemon.py)."""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import time

from exporter.kernel import libbpf, maps, tcp_h

log = logging.getLogger(__name__)

# probe -> (the hash map of what it follows, whose entries are counted
# forgotten; the other maps it keeps, emptied; its counts, zeroed: each a
# global variable, (section, name), that only that probe's programs write)
FOLLOWED = {
    "tcp_timewait": ("timewait_socks", (), ((".bss.timers", "timewait_tracked"),)),
    "tcp_request": ("request_socks", ("request_listeners", "request_slot"),
                    ((".bss.requests", "requests_tracked"), (".bss.requests", "request_slots_armed"))),
}
ROWS = {"tcp_timewait": tcp_h.OBS_TIMEWAIT + tcp_h.TW_FORGOTTEN,
        "tcp_request": tcp_h.OBS_REQUESTS + tcp_h.REQ_FORGOTTEN}
BPF_MAP_TYPE_PERCPU_ARRAY = 6

# membarrier(2): MEMBARRIER_CMD_GLOBAL is synchronize_rcu() (kernel/sched/membarrier.c)
_MEMBARRIER = {"x86_64": 324, "aarch64": 283}
MEMBARRIER_CMD_GLOBAL = 1


def grace_period() -> None:
    """Wait until no program a link destroyed before this call still runs:
    a BPF tracepoint program runs under rcu_read_lock, and a link's
    destroy does not wait for those running (the kernel frees the program
    after a grace period). Where membarrier refuses (nohz_full CPUs), a
    pause far longer than any program's run."""
    nr = _MEMBARRIER.get(platform.machine())
    if nr is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(nr, MEMBARRIER_CMD_GLOBAL, 0, 0) == 0:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    time.sleep(0.1)


def _empty(fd: int, info: tuple) -> int:
    """Every entry of a map deleted (a hash) or zeroed (a per-CPU array);
    returns how many a hash had. info: the loader's (type, key size, value
    size, max entries)."""
    mtype, key_size, value_size, max_entries = info[:4]
    if mtype == BPF_MAP_TYPE_PERCPU_ARRAY:
        zero = bytes((value_size + 7) // 8 * 8 * libbpf.possible_cpus())
        for k in range(max_entries):
            maps.update(fd, k.to_bytes(4, "little"), zero)
        return 0
    n = 0
    for key in list(maps.keys(fd, key_size)):
        maps.delete(fd, key)
        n += 1
    return n


def var_offsets(obj_path: str, wanted) -> dict:
    """(section, name) -> (offset, size) of global variables, from the
    object's symbol table (pyelftools)."""
    from elftools.elf.elffile import ELFFile
    out = {}
    with open(obj_path, "rb") as f:
        elf = ELFFile(f)
        names = [s.name for s in elf.iter_sections()]
        for sym in elf.get_section_by_name(".symtab").iter_symbols():
            shndx = sym["st_shndx"]
            key = (names[shndx] if isinstance(shndx, int) else "", sym.name)
            if key in wanted:
                out[key] = (sym["st_value"], sym["st_size"])
    missing = set(wanted) - set(out)
    if missing:
        raise OSError(f"{obj_path}: no global variable {', '.join(f'{s}:{n}' for s, n in sorted(missing))}")
    return out


def zero_vars(fd: int, value_size: int, spans) -> None:
    """Zero (offset, size) spans of a global-data map's one value, each by a
    store to it alone through the map's memory (libbpf makes these maps
    BPF_F_MMAPABLE): the section's other variables, which programs still
    attached may be adding to, are not written."""
    size = -(-value_size // mmap.PAGESIZE) * mmap.PAGESIZE
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        for off, n in spans:
            m[off:off + n] = bytes(n)


def forget(probes, map_fds: dict, map_info: dict, obj_path: str) -> dict:
    """The maps of these probes (just detached) emptied and their counts
    zeroed; returns {obs_counters row: entries forgotten}. A failure is
    logged, not raised (the reload goes on): a count not zeroed leaves its
    programs, attached again, looking further at every timer of their kind."""
    probes = [p for p in probes if p in FOLLOWED]
    if not probes:
        return {}
    grace_period()
    out = {}
    for probe in probes:
        table, others, counts = FOLLOWED[probe]
        try:
            out[ROWS[probe]] = _empty(map_fds[table], map_info[table])
            for name in others:
                _empty(map_fds[name], map_info[name])
            offsets = var_offsets(obj_path, counts)
            for section, name in counts:
                zero_vars(map_fds[section], map_info[section][2], [offsets[(section, name)]])
        except (OSError, ValueError) as e:
            log.error("probe %s: what its programs followed not all forgotten: %s", probe, e)
    return out
