"""Kernel function addresses the TIME_WAIT and request programs compare with
(struct nettap_ksyms, bpf/tcp.h; bpf/timewait.bpf.c, bpf/request.bpf.c), read from /proc/kallsyms and
written into the object's .data.ksyms section before those programs are
attached. Read only then, when a config asks for their records: the kernel
takes ~0.1 s of CPU to list its symbols."""
from __future__ import annotations

import bisect
import functools
import re
import struct

from exporter.kernel import maps, tcp_h

KALLSYMS = "/proc/kallsyms"
MAP = ".data.ksyms"
# The programs that read struct nettap_ksyms; the TIME_WAIT ones apart (the
# timer function's address is written only while they are attached: tcp_state
# counts a TIME_WAIT socket not tied to its connection only then).
TIMEWAIT_PROGRAMS = ("tcp_timewait", "tcp_timewait_end", "tcp_timewait_expire")
PROGRAMS = TIMEWAIT_PROGRAMS + ("tcp_request", "tcp_request_compat", "tcp_request_end", "tcp_request_exit",
                             "tcp_request_state")
HANDLER, DESCHEDULE = "tw_timer_handler", "inet_twsk_deschedule_put"
# The callers of inet_twsk_deschedule_put, each with the NETTAP_TW_* it kills
# a TIME_WAIT socket by (0: by its substate, bpf/timewait.bpf.c); the purge
# is found by its cause too (the program checks it alone, where it inlines
# inet_twsk_deschedule_put).
CALLERS = (("tcp_timewait_state_process", tcp_h.TW_RESET), ("__inet_check_established", tcp_h.TW_REUSED),
           ("__inet_hash_connect", tcp_h.TW_REUSED), ("tcp_v4_rcv", 0), ("tcp_v6_rcv", 0),
           ("inet_twsk_purge", tcp_h.TW_PURGED))
REQ_HANDLER = "reqsk_timer_handler"
# The functions that end a request socket early, by the NETTAP_REQ_* they
# end it with (the innermost on the stack names it, bpf/request.bpf.c), and
# those that make a socket from a SYN cookie's ACK (no request socket).
REQ_CALLERS = (("inet_csk_complete_hashdance", tcp_h.REQ_ESTABLISHED), ("tcp_check_req", tcp_h.REQ_RESET),
               ("tcp_v4_rcv", tcp_h.REQ_CLOSED), ("tcp_v6_rcv", tcp_h.REQ_CLOSED),
               ("tcp_get_cookie_sock", tcp_h.REQ_COOKIE), ("cookie_v4_check", tcp_h.REQ_COOKIE),
               ("cookie_v6_check", tcp_h.REQ_COOKIE))
# A function's compiler clones, each a symbol of its own (gcc's suffixes;
# clang's .llvm.N), as the stack shows them.
CLONE = rb"(?:\.(?:constprop|isra|part|llvm)\.\d+|\.cold)*"


def resolve(names, path: str = KALLSYMS) -> dict:
    """name -> [(start, end), ...] of the kernel's text symbols of that name
    and of its clones (name.constprop.N, .isra.N, .part.N, .cold): the
    function's own first, then its clones in the file's order; end is the
    next symbol's address. Absent names are left out. Raises OSError where
    the kernel hides its addresses (kptr_restrict)."""
    with open(path, "rb") as f:
        data = f.read()
    wanted = b"|".join(re.escape(n.encode()) for n in names)
    out: dict = {}
    addrs = None
    pattern = rb"^([0-9a-f]+) [tT] (" + wanted + rb")(" + CLONE + rb")(?:\t\[\w+\])?\n"
    for m in re.finditer(pattern, data, re.M):
        name, start = m.group(2).decode(), int(m.group(1), 16)
        if not start:
            raise OSError(f"{path} hides the kernel's addresses (kernel.kptr_restrict, or no CAP_SYSLOG)")
        nxt = re.compile(rb"([0-9a-f]+) ").match(data, m.end())
        end = int(nxt.group(1), 16) if nxt else 0
        if end <= start:      # out of order (a module's symbols): the nearest address above
            if addrs is None:
                addrs = sorted(int(x, 16) for x in re.findall(rb"^([0-9a-f]+) ", data, re.M))
            end = next((a for a in addrs[bisect.bisect_right(addrs, start):]), start + 1)
        ranges = out.setdefault(name, [])
        if (start, end) not in ranges:
            ranges.insert(0 if not m.group(3) else len(ranges), (start, end))
    return out


def _slots(syms: dict, callers, count: int) -> list:
    """count slots of (start, end, cause), one for each range of each
    function in callers' order, the rest 0."""
    rows = [(*r, cause) for name, cause in callers for r in syms.get(name, ())][:count]
    rows += [(0, 0, 0)] * (count - len(rows))
    return [w for row in rows for w in row]


@functools.lru_cache(maxsize=8)
def settings(path: str = KALLSYMS, timewait: bool = True) -> bytes:
    """struct nettap_ksyms for this kernel, read once a process (the core
    kernel's text does not move; a module's, tcp_v6_rcv's, only when it is
    reloaded); timewait False: the TIME_WAIT timer function left 0 (its
    programs detached). Raises OSError when a timer's function or
    inet_twsk_deschedule_put is not found (a caller not found stays 0: its
    kills are told as `killed`)."""
    syms = resolve([HANDLER, DESCHEDULE, REQ_HANDLER] + [n for n, _ in CALLERS + REQ_CALLERS], path)
    for need in (HANDLER, DESCHEDULE, REQ_HANDLER):
        if need not in syms:
            raise OSError(f"no {need} in {path}: TIME_WAIT and request sockets cannot be told")
    desc = [w for r in syms[DESCHEDULE][:tcp_h.KSYM_DESCHEDULE] for w in r]
    words = [syms[HANDLER][0][0] if timewait else 0, *desc, *[0] * (tcp_h.KSYM_DESCHEDULE * 2 - len(desc))]
    words += _slots(syms, CALLERS, tcp_h.KSYM_CALLERS)
    words.append(syms[REQ_HANDLER][0][0])
    words += _slots(syms, REQ_CALLERS, tcp_h.KSYM_REQ_CALLERS)
    size = tcp_h.STRUCTS["nettap_ksyms"][0]
    assert len(words) * 8 == size
    return struct.pack(f"<{len(words)}Q", *words)


def write(map_fd: int, value_size: int, path: str = KALLSYMS, timewait: bool = True) -> None:
    """Write struct nettap_ksyms into the .data.ksyms map (its one value,
    the section, whose only variable it is)."""
    raw = settings(path, timewait)
    maps.update(map_fd, (0).to_bytes(4, "little"), raw.ljust(value_size, b"\0"))
