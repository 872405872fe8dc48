"""TLS plaintext: the libssl files on this node, and the TLS uprobes on them
(bpf/entry_tls.bpf.h).

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

from exporter.kernel import libbpf
from exporter.kernel.mechanisms import UNSUPPORTED

log = logging.getLogger(__name__)

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"
PROBES = ("ssl_write", "ssl_read", "ssl_handshake")
# probe -> the symbols it covers: (symbol, its entry program)
SYMBOLS = {
    "ssl_write": (("SSL_write", "ssl_write_enter"), ("SSL_write_ex", "ssl_write_ex_enter")),
    "ssl_read": (("SSL_read", "ssl_read_enter"), ("SSL_read_ex", "ssl_read_ex_enter")),
    "ssl_handshake": (("SSL_do_handshake", "ssl_handshake_enter"),),
}
# probe -> its return program (the fast variant's name; compat's ends in _compat)
RETURNS = {"ssl_write": "ssl_write_exit", "ssl_read": "ssl_read_exit", "ssl_handshake": "ssl_handshake_exit"}
# Where an SSL object's socket is forgotten (bpf/entry_tls.bpf.h ssl_free): its
# end, and its reset for another connection (SSL_new calls SSL_clear). Attached
# first, and a file without them is not attached: (symbol, program).
FORGET = (("SSL_free", "ssl_free"), ("SSL_clear", "ssl_free"))
# The linker's directories on Debian, Red Hat, Alpine and the like.
SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
               "/lib/*-linux-gnu", "/usr/lib/*-linux-gnu")
_LIBSSL = re.compile(r"^libssl\.so(\.\d+)+$")     # OpenSSL's versioned file

# The files attached at once, and of them those one user other than root
# brought (its processes mapped them): each costs ~24 fds (a uprobe and its
# link per symbol, return and forget probe) and ~1 s of the exit (the kernel detaches
# uprobes one at a time, each waiting out RCU grace periods).
MAX_FILES, MAX_USER_FILES = 16, 4
FDS_PER_FILE = 24
FD_RESERVE = 256            # fds never taken by attaches: reloads, scrapes, the sink
DEADLINE = 5.0              # s one file (or one process's maps) may take before it is skipped
MAX_ABANDONED = 8           # workers abandoned on such files before attaching stops
SWEEP_INTERVAL = 10.0       # s between looks for files no process maps any more
FAILED_KEPT = 8             # refused files named in the probes' state
# nettap_tls_files_refused_total's reasons
REASONS = ("limit", "user_limit", "fds", "not_regular", "not_mapped", "fuse", "timeout", "no_symbols", "error")
LIMIT_WHY = {"limit": f"{MAX_FILES} libssl files attached already",
             "user_limit": f"{MAX_USER_FILES} libssl files of this user attached already",
             "fds": f"fewer than {FD_RESERVE} file descriptors would be left"}


def supported() -> tuple:
    """(True, "") where the kernel has uprobes (a perf PMU), else (False, why)."""
    if os.path.exists(UPROBE_PMU):
        return True, ""
    return False, "this kernel has no uprobes (no uprobe PMU)"


MMAP = "tls_mmap"          # sys_enter_mmap: a libssl file mapped to run (the dlopen ring)


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


def attach_uprobe(prog: int, path: str, sym: str, retprobe: bool) -> int:
    """A link of program prog (a bpf_program *) on sym of the file at path,
    in every process (pid -1); OSError as libbpf reports it (ENOENT: the file
    has no such symbol)."""
    fn = getattr(libbpf.lib(), _ATTACH)
    fn.restype = c_void_p
    fn.argtypes = [c_void_p, c_int, c_char_p, c_size_t, ctypes.POINTER(bpf_uprobe_opts)]
    opts = bpf_uprobe_opts(sz=ctypes.sizeof(bpf_uprobe_opts), retprobe=retprobe, func_name=sym.encode())
    ctypes.set_errno(0)
    return libbpf.check_ptr(f"{_ATTACH}({sym})", fn(prog, -1, path.encode(), 0, ctypes.byref(opts)))


def attach_symbols(prog, variant: str, path: str) -> tuple:
    """Attach every TLS symbol the file at path has: (links, symbols per
    probe, the error that stopped it or ""). prog(name): a bpf_program *."""
    made, counts = [], {p: 0 for p in PROBES}
    try:
        for sym, name in FORGET:
            made.append(attach_uprobe(prog(name), path, sym, False))
        for probe, syms in SYMBOLS.items():
            ret = RETURNS.get(probe)
            if ret and variant != "fast":
                ret = f"{ret}_compat"
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


def report(states: dict, symbols: dict, failed: dict) -> None:
    """Each TLS probe's state (mechanisms.ProbeState): attached where some
    file carries its symbols; a node without libssl is not a failure."""
    for p, st in states.items():
        st.mechanism, st.attached = "uprobe", symbols[p] > 0
        if st.attached:
            st.error = ""
        elif failed:
            st.error = "; ".join(f"{f}: {why}" for f, why in failed.items())
        else:
            st.mechanism, st.error = UNSUPPORTED, "no libssl.so file on this node"


def free_fds() -> int:
    """File descriptors this process may still open (its soft limit)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return soft - len(os.listdir("/proc/self/fd"))
