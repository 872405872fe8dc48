"""TLS plaintext: the libssl files on this node, and the TLS uprobes on them
(bpf/tls.bpf.c).

A uprobe belongs to a file (its inode and an offset), not to a process:
attached with pid -1 to a libssl file, it runs in every process that maps
that file, now or later. A Python that imports ``ssl`` after nettap started
is covered with no further work; the programs decide per process and socket
(bpf/tls.bpf.h). Files are found at start and whenever the targets change:
the system's libssl (the linker's directories, symlinks not followed) and
those that running processes map (``/proc/PID/maps``; each opened as the
mapping's own file, libfiles.py, so a container's copy is found and no
name a user plants is followed), each attached once per (device, inode).

Any user can map files, so what they cost is bounded: MAX_FILES attached
at once (MAX_USER_FILES of one user other than root), FD_RESERVE fds left
free, a file no process maps any more detached; refusals are counted
(nettap_tls_files_refused_total) and alerted.

Only OpenSSL's shared library is seen (``libssl.so.3``, ``libssl.so.1.1``):
TLS linked statically into a program (Go's crypto/tls, BoringSSL in Envoy,
rustls) never calls it. NSS's ``libssl3.so`` is another library.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import logging
import os
import re
import resource
from ctypes import Structure, c_bool, c_char_p, c_int, c_size_t, c_uint64, c_void_p

from exporter.kernel import gotables, libbpf, uprobe_multi
from exporter.kernel import programs as table
from exporter.kernel.mechanisms import UNSUPPORTED

log = logging.getLogger(__name__)

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"
# The TLS probes and their programs, from the programs' tags (bpf/tls.bpf.c).
PROBES = tuple(table.uprobe())
# probe -> the symbols it covers: (symbol, its entry program)
SYMBOLS = {p: tuple((sym, n) for n in table.names(p, table.UPROBE, only=True) if not table.is_return(n)
                    for sym in table.attach(n)) for p in PROBES}
# probe -> its return program (the fast variant's name; compat's ends in _compat)
RETURNS = {p: n for p in PROBES for n in table.names(p, table.UPROBE, only=True) if table.is_return(n)}
# Where an SSL object's socket is forgotten (ssl_free: the uprobe every TLS
# probe shares): its end, and its reset for another connection (SSL_new calls
# SSL_clear). Attached first, and a file without them is not attached: (symbol, program).
FORGET = tuple(dict.fromkeys((sym, n) for p in PROBES for n in table.names(p, table.UPROBE)
                             if n not in table.names(p, table.UPROBE, only=True) for sym in table.attach(n)))
# The linker's directories on Debian, Red Hat, Alpine and the like.
SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
               "/lib/*-linux-gnu", "/usr/lib/*-linux-gnu")
_LIBSSL = re.compile(r"^libssl\.so(\.\d+)+$")     # OpenSSL's versioned file

# The files attached at once, and of them those one user other than root
# brought (its processes mapped them). Each costs, with perf-event uprobes
# (before Linux 6.6), ~24 fds (a uprobe and its link per symbol, return and
# forget probe) and ~1 s of the exit (the kernel detaches them one at a
# time, each waiting out RCU grace periods); with uprobe_multi links, 9 fds
# (a link per program) and a few ms (links detach side by side: uprobe_multi.py).
MAX_FILES, MAX_USER_FILES = 16, 4
FDS_PER_FILE = {"uprobe": 24, "uprobe_multi": 9}
# NETTAP_TLS_UPROBE=uprobe: perf-event uprobes even where uprobe_multi links
# exist (the tests run both ways on one kernel)
FORCE_ENV = "NETTAP_TLS_UPROBE"
FD_RESERVE = 256            # fds never taken by attaches: reloads, scrapes, the sink
DEADLINE = 5.0              # s one file (or one process's maps) may take before it is skipped
MAX_ABANDONED = 8           # workers abandoned on such files before attaching stops
SWEEP_INTERVAL = 10.0       # s between looks for files no process maps any more
FAILED_KEPT = 8             # refused files named in the probes' state
# nettap_tls_files_refused_total's reasons
REASONS = ("limit", "user_limit", "fds", "not_regular", "not_mapped", "fuse", "timeout", "no_symbols",
           "error") + gotables.REASONS       # and a Go program's (goelf.py)
LIMIT_WHY = {"limit": f"{MAX_FILES} libssl files attached already",
             "user_limit": f"{MAX_USER_FILES} libssl files of this user attached already",
             "fds": f"fewer than {FD_RESERVE} file descriptors would be left"}


def supported() -> tuple:
    """(True, "") where the kernel has uprobes (a perf PMU), else (False, why)."""
    if os.path.exists(UPROBE_PMU):
        return True, ""
    return False, "this kernel has no uprobes (no uprobe PMU)"


# sys_enter_mmap: a libssl file mapped to run (the dlopen ring): TLS's one tracepoint program
MMAP = table.names(PROBES[0], "tracepoint")[0]


def programs(variant: str) -> list:
    """Every TLS program of a variant (the entries have one variant only)."""
    entries = [prog for syms in SYMBOLS.values() for _sym, prog in syms]
    rets = [p if variant == "fast" else f"{p}_compat" for p in RETURNS.values()]
    return rets + entries + list(dict.fromkeys(p for _s, p in FORGET)) + [MMAP]


def is_libssl(path: str) -> bool:
    return bool(_LIBSSL.match(os.path.basename(path)))


def system_files() -> list:
    """The libssl files in the linker's directories."""
    found = []
    for pattern in SYSTEM_DIRS:
        for d in sorted(glob.glob(pattern)):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            found += [os.path.join(d, n) for n in sorted(names) if is_libssl(n)]
    return found


class bpf_uprobe_opts(Structure):
    """``struct bpf_uprobe_opts`` of libbpf 1.1 (bpf/libbpf.h), to func_name."""

    _fields_ = [("sz", c_size_t), ("ref_ctr_offset", c_size_t), ("bpf_cookie", c_uint64),
                ("retprobe", c_bool), ("func_name", c_char_p)]


_ATTACH = "bpf_program__attach_uprobe_opts"


def attach_uprobe(prog: int, path: str, sym: str | None, retprobe: bool, offset: int = 0) -> int:
    """A link of program prog (a bpf_program *) on sym of the file at path
    (None: at file offset `offset`), in every process (pid -1); OSError as
    libbpf reports it (ENOENT: the file has no such symbol)."""
    fn = getattr(libbpf.lib(), _ATTACH)
    fn.restype = c_void_p
    fn.argtypes = [c_void_p, c_int, c_char_p, c_size_t, ctypes.POINTER(bpf_uprobe_opts)]
    opts = bpf_uprobe_opts(sz=ctypes.sizeof(bpf_uprobe_opts), retprobe=retprobe,
                           func_name=sym.encode() if sym else None)
    ctypes.set_errno(0)
    return libbpf.check_ptr(f"{_ATTACH}({sym or hex(offset)})",
                            fn(prog, -1, path.encode(), offset, ctypes.byref(opts)))


def mechanism(features: list) -> str:
    """How files are attached: "uprobe_multi" where the kernel has the
    links (6.6+) and NETTAP_TLS_UPROBE does not ask otherwise, "uprobe"."""
    have = any(f.name == "uprobe_multi" and f.present for f in features)
    return "uprobe_multi" if have and os.environ.get(FORCE_ENV) != "uprobe" else "uprobe"


def prepare(obj: int, mech: str) -> None:
    """Before load: the uprobe programs of both variants and libraries
    (libssl's, Go's: gotls.py) loaded for uprobe_multi links where that is
    the mechanism (the kernel refuses a multi link to a program not loaded
    for it)."""
    if mech != "uprobe_multi":
        return
    find = libbpf.lib().bpf_object__find_program_by_name
    names = (n for lib in table.LIBS for p in table.uprobe(lib) for v in ("fast", "compat")
             for n in table.names(p, table.UPROBE, v))
    for name in dict.fromkeys(names):
        prog = find(obj, name.encode())
        if prog:
            libbpf.call("bpf_program__set_expected_attach_type", prog, uprobe_multi.BPF_TRACE_UPROBE_MULTI)


def _return(probe: str, variant: str):
    ret = RETURNS.get(probe)
    return f"{ret}_compat" if ret and variant != "fast" else ret


def attach_symbols(prog, variant: str, path: str, mech: str = "uprobe") -> tuple:
    """Attach every TLS symbol the file at path has: (links, symbols per
    probe, the error that stopped it or ""). prog(name): a bpf_program *."""
    if mech == "uprobe_multi":
        return attach_multi(prog, variant, path)
    made, counts = [], {p: 0 for p in PROBES}
    try:
        for sym, name in FORGET:
            made.append(attach_uprobe(prog(name), path, sym, False))
        for probe, syms in SYMBOLS.items():
            ret = _return(probe, variant)
            for sym, entry in syms:
                if ret:
                    try:
                        # the return first: no entry is kept without its return
                        made.append(attach_uprobe(prog(ret), path, sym, True))
                    except OSError as e:
                        if e.errno != errno.ENOENT:     # not the symbol missing (1.1.0 has no _ex)
                            raise
                        continue
                made.append(attach_uprobe(prog(entry), path, sym, False))
                counts[probe] += 1
    except OSError as e:
        return made, counts, str(e)
    return made, counts, ""


def attach_multi(prog, variant: str, path: str) -> tuple:
    """attach_symbols with a uprobe_multi link per program: its symbols'
    offsets read from the file (.dynsym, .symtab); the forget probes first,
    a probe's return before its entries."""
    made, counts = [], {p: 0 for p in PROBES}
    names = [s for s, _p in FORGET] + [s for syms in SYMBOLS.values() for s, _p in syms]
    try:
        offs = uprobe_multi.symbol_offsets(path, names)
    except Exception as e:          # OSError, elftools' ELFError and its parse errors
        return made, counts, f"{path}: not an ELF file nettap can read ({e})"
    missing = [s for s, _p in FORGET if s not in offs]
    if missing:
        return made, counts, f"{path}: no symbol {missing[0]}"

    def link(name: str, syms: list, ret: bool) -> None:
        fd = uprobe_multi.prog_fd(prog(name))
        made.append(uprobe_multi.link(fd, path, [offs[s] for s in syms], ret))
    try:
        for name in dict.fromkeys(p for _s, p in FORGET):
            link(name, [s for s, p in FORGET if p == name], False)
        for probe, syms in SYMBOLS.items():
            have = [(s, e) for s, e in syms if s in offs]
            if have and _return(probe, variant):
                link(_return(probe, variant), [s for s, _e in have], True)
            for sym, entry in have:
                link(entry, [sym], False)
                counts[probe] += 1
    except OSError as e:
        return made, counts, str(e)
    return made, counts, ""


def report(states: dict, symbols: dict, failed: dict, mech: str = "uprobe", idle: dict | None = None) -> None:
    """Each TLS probe's state (mechanisms.ProbeState): attached where some
    file carries its symbols; no file to attach is not a failure (idle:
    probe -> why none is attached, then)."""
    for p, st in states.items():
        st.mechanism, st.attached = mech, symbols[p] > 0
        if st.attached:
            st.error = ""
        elif failed:
            st.error = "; ".join(f"{f}: {why}" for f, why in failed.items())
        else:
            st.mechanism, st.error = UNSUPPORTED, (idle or {}).get(p, "no libssl.so file on this node")


def free_fds() -> int:
    """File descriptors this process may still open (its soft limit)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return soft - len(os.listdir("/proc/self/fd"))
