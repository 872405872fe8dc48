"""TLS plaintext: the libssl files on this node, and the TLS uprobes on them
(bpf/entry_tls.bpf.h).

A uprobe belongs to a file (its inode and an offset), not to a process:
attached with pid -1 to a libssl file, it runs in every process that maps
that file, now or later. A Python that imports ``ssl`` after nettap started
is covered with no further work; the programs decide per process and socket
(bpf/tls.bpf.h). Files are found at start and whenever the targets change:
the system's libssl (the linker's directories) and those that running
processes map (``/proc/PID/maps``, opened through ``/proc/PID/root`` so a
container's own copy is found), each attached once per (device, inode).

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


def mapped_files(proc: str = "/proc", pids=None) -> list:
    """The libssl files that running processes (or those of pids) map, as
    paths through each process's root (its container's file system)."""
    found = []
    for pid in (os.listdir(proc) if pids is None else map(str, pids)):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc, pid, "maps"), "rb") as f:
                data = f.read()
        except OSError:                 # gone, or a kernel thread
            continue
        if b"libssl.so" not in data:
            continue
        for line in data.decode(errors="replace").splitlines():
            # Any mapping of the file, not only its executable one: a dlopen
            # record is made at the entry of the mmap that maps the code, and
            # may be read before that mmap returns; the dynamic linker has
            # mapped the whole file (read-only) just before.
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].removesuffix(" (deleted)")
            if not is_libssl(path):
                continue
            if path != parts[5]:        # replaced on disk since (an upgrade): the mapped file itself
                found.append(os.path.join(proc, pid, "map_files", parts[0]))
            else:
                found.append(os.path.join(proc, pid, "root") + path)
    return list(dict.fromkeys(found))           # a file has several mappings


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


class TlsProbes:
    """The TLS uprobes of one loaded object: which files carry them, and
    their links (the loader destroys them)."""

    def __init__(self, obj: int, variant: str):
        self.obj, self.variant = obj, variant
        self.links: list = []
        # libssl files mapped from now on are told on the dlopen ring
        self.links.append(libbpf.call_ptr("bpf_program__attach_tracepoint", self._prog(MMAP),
                                          b"syscalls", b"sys_enter_mmap"))
        self.files: dict = {}       # (dev, ino) -> path attached
        self.failed: dict = {}      # path -> why not
        self.symbols: dict = {p: 0 for p in PROBES}   # probe -> symbols attached, all files

    def _prog(self, name: str) -> int:
        return libbpf.call_ptr("bpf_object__find_program_by_name", self.obj, name.encode())

    def _link(self, prog: str, path: str, sym: str, retprobe: bool) -> int:
        return attach_uprobe(self._prog(prog), path, sym, retprobe)

    def attach_file(self, path: str) -> bool:
        """Attach every TLS symbol the file has; False (and why, in failed)
        when it has none or the kernel refuses."""
        try:
            st = os.stat(path)
        except OSError as e:
            self.failed[path] = e.strerror
            return False
        key = (st.st_dev, st.st_ino)
        if key in self.files:
            return True
        made, counts, error = [], {p: 0 for p in PROBES}, ""
        try:
            for sym, prog in FORGET:
                made.append(self._link(prog, path, sym, False))
            for probe, syms in SYMBOLS.items():
                ret = RETURNS[probe] if self.variant == "fast" else f"{RETURNS[probe]}_compat"
                for sym, entry in syms:
                    try:
                        # the return first: no entry is kept without its return
                        made.append(self._link(ret, path, sym, True))
                    except OSError as e:
                        if e.errno != errno.ENOENT:     # not the symbol missing (1.1.0 has no _ex)
                            raise
                        continue
                    made.append(self._link(entry, path, sym, False))
                    counts[probe] += 1
        except OSError as e:
            error = str(e)
        if error or not any(counts.values()):
            for link in made:
                libbpf.lib().bpf_link__destroy(link)
            self.failed[path] = error or "no SSL_read/SSL_write symbol"
            log.warning("TLS probes not attached to %s: %s", path, self.failed[path])
            return False
        self.links += made
        self.files[key] = path
        for p in PROBES:
            self.symbols[p] += counts[p]
        log.info("TLS probes attached to %s", path)
        return True

    def attach_mapped(self, pids, proc: str = "/proc") -> int:
        """Attach to the libssl files these processes map (a dlopen record's);
        returns how many files were newly attached. A process gone already
        (a short command) is not found: its file, if new, waits for the next
        process that maps it, or the next rescan."""
        before = len(self.files)
        for path in mapped_files(proc, pids):
            self.attach_file(path)
        return len(self.files) - before

    def report(self, states: dict) -> None:
        """Each TLS probe's state (mechanisms.ProbeState): attached where some
        file carries its symbols; a node without libssl is not a failure."""
        for p, st in states.items():
            st.mechanism, st.attached = "uprobe", self.symbols[p] > 0
            if st.attached:
                st.error = ""
            elif self.failed:
                st.error = "; ".join(f"{f}: {why}" for f, why in self.failed.items())
            else:
                st.mechanism, st.error = UNSUPPORTED, "no libssl.so file on this node"

    def scan(self, proc: str = "/proc") -> int:
        """Attach to every libssl file not yet attached: the system's and the
        running processes'. Returns how many files were newly attached."""
        before = len(self.files)
        for path in system_files() + mapped_files(proc):
            self.attach_file(path)
        return len(self.files) - before
