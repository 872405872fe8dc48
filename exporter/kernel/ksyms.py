"""Kernel function addresses the TIME_WAIT and request programs compare with
(struct nettap_ksyms, bpf/tcp.h; bpf/timewait.bpf.c, bpf/request.bpf.c), read from /proc/kallsyms and
written into the object's .data.ksyms section before those programs are
attached. Read only then, when a config asks for their records: the kernel
takes ~0.1 s of CPU to list its symbols."""
from __future__ import annotations

import functools
import re
import struct

from exporter.kernel import maps, tcp_h

KALLSYMS = "/proc/kallsyms"
MAP = ".data.ksyms"
# The programs that read struct nettap_ksyms.
PROGRAMS = ("tcp_timewait", "tcp_timewait_end", "tcp_request", "tcp_request_end", "tcp_request_exit")
HANDLER, DESCHEDULE = "tw_timer_handler", "inet_twsk_deschedule_put"
# The callers of inet_twsk_deschedule_put, each with the NETTAP_TW_* it kills
# a TIME_WAIT socket by (0: by its substate, bpf/timewait.bpf.c), in
# nettap_ksyms.tw_callers' order; the purge last (the program checks it
# alone too, where it inlines inet_twsk_deschedule_put).
CALLERS = (("tcp_timewait_state_process", tcp_h.TW_RESET), ("__inet_check_established", tcp_h.TW_REUSED),
           ("__inet_hash_connect", tcp_h.TW_REUSED), ("tcp_v4_rcv", 0), ("tcp_v6_rcv", 0),
           ("inet_twsk_purge", tcp_h.TW_PURGED))
assert len(CALLERS) == tcp_h.KSYM_CALLERS
REQ_HANDLER = "reqsk_timer_handler"
# The functions that end a request socket early, by the NETTAP_REQ_* they
# end it with (the innermost on the stack names it, bpf/request.bpf.c).
REQ_CALLERS = (("inet_csk_complete_hashdance", tcp_h.REQ_ESTABLISHED), ("tcp_check_req", tcp_h.REQ_RESET),
               ("tcp_v4_rcv", tcp_h.REQ_CLOSED), ("tcp_v6_rcv", tcp_h.REQ_CLOSED))
assert len(REQ_CALLERS) == tcp_h.KSYM_REQ_CALLERS


def resolve(names, path: str = KALLSYMS) -> dict:
    """name -> (start, end) of the kernel's text symbols named (the first
    of a name); end is the next symbol's address. Absent names are left out.
    Raises OSError where the kernel hides its addresses (kptr_restrict)."""
    with open(path, "rb") as f:
        data = f.read()
    wanted = b"|".join(re.escape(n.encode()) for n in names)
    out = {}
    for m in re.finditer(rb"^([0-9a-f]+) [tT] (" + wanted + rb")(?:\t\[\w+\])?\n", data, re.M):
        name, start = m.group(2).decode(), int(m.group(1), 16)
        if name in out:
            continue
        if not start:
            raise OSError(f"{path} hides the kernel's addresses (kernel.kptr_restrict, or no CAP_SYSLOG)")
        nxt = re.compile(rb"([0-9a-f]+) ").match(data, m.end())
        end = int(nxt.group(1), 16) if nxt else 0
        if end <= start:      # out of order (a module's symbols): the nearest address above
            end = min((a for a in map(lambda x: int(x, 16), re.findall(rb"^([0-9a-f]+) ", data, re.M))
                       if a > start), default=start + 1)
        out[name] = (start, end)
    return out


@functools.lru_cache(maxsize=4)
def settings(path: str = KALLSYMS) -> bytes:
    """struct nettap_ksyms for this kernel, read once a process (the core
    kernel's text does not move; a module's, tcp_v6_rcv's, only when it is
    reloaded). Raises OSError when the timer's
    function or inet_twsk_deschedule_put is not found (a caller not found
    stays 0: its kills are told as `killed`)."""
    syms = resolve([HANDLER, DESCHEDULE, REQ_HANDLER] + [n for n, _ in CALLERS + REQ_CALLERS], path)
    for need in (HANDLER, DESCHEDULE, REQ_HANDLER):
        if need not in syms:
            raise OSError(f"no {need} in {path}: TIME_WAIT and request sockets cannot be told")
    words = [syms[HANDLER][0], *syms[DESCHEDULE]]
    for name, cause in CALLERS:
        words += [*syms.get(name, (0, 0)), cause]
    words.append(syms[REQ_HANDLER][0])
    for name, cause in REQ_CALLERS:
        words += [*syms.get(name, (0, 0)), cause]
    size = tcp_h.STRUCTS["nettap_ksyms"][0]
    assert len(words) * 8 == size
    return struct.pack(f"<{len(words)}Q", *words)


def write(map_fd: int, value_size: int, path: str = KALLSYMS) -> None:
    """Write struct nettap_ksyms into the .data.ksyms map (its one value,
    the section, whose only variable it is)."""
    raw = settings(path)
    maps.update(map_fd, (0).to_bytes(4, "little"), raw.ljust(value_size, b"\0"))
