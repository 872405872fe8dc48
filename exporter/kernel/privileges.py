"""nettap's privileges: which capabilities it needs, and dropping the ones
reloads do not need once the probes are attached.

To start (README, *Privileges*): CAP_BPF (load programs, create maps),
CAP_PERFMON (attach to tracepoints, read kernel memory from the programs),
CAP_DAC_READ_SEARCH (read tracepoint ids in tracefs, mode 0700), and before
Linux 5.11 CAP_SYS_RESOURCE (RLIMIT_MEMLOCK for maps). CAP_SYS_ADMIN only
for bpfStats (BPF_ENABLE_STATS) and scope node, or to mount tracefs where
it is not mounted; CAP_SYS_PTRACE for scope node and netns targets given as
another user's /proc/PID/ns/net.

After attach nothing needs CAP_BPF, CAP_PERFMON or CAP_SYS_RESOURCE again:
maps are read and written through the fds nettap holds, which needs no
capability, and the stats probe program is loaded before the drop.
:func:`drop_after_attach` keeps only what a reload may use, sets
PR_SET_NO_NEW_PRIVS (an exec gains nothing) and clears the inheritable and
ambient sets. Capabilities belong to each thread (kernel/capability.c): call
it while the process has one thread, before the pipeline and server start.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

# include/uapi/linux/capability.h
CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
        "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19,
        "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4    # uapi/linux/prctl.h

REQUIRED = ("CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH")
REQUIRED_BEFORE_5_11 = ("CAP_SYS_RESOURCE",)       # BPF memory charged to RLIMIT_MEMLOCK, not the memcg
# Before 6.2 the kernel lacks the kfunc bpf_rdonly_cast (the fast variant's,
# declared weak): libbpf 1.1 then searches the modules' BTF for it, and
# listing BTF objects (BPF_BTF_GET_NEXT_ID) needs CAP_SYS_ADMIN there; without
# it the load fails (seen as nobody on Debian's 6.1 in the kernel matrix).
REQUIRED_BEFORE_6_2 = ("CAP_SYS_ADMIN",)

# What a reload may still use, kept if held: the statistics switch and the
# node-wide view, netns targets of other users' processes, the listen port.
KEEP = ("CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_BIND_SERVICE")
KEEP_WITH_SYS_ADMIN = ("CAP_DAC_READ_SEARCH",)     # scope node lists other users' /proc/PID/fd


class _Header(ctypes.Structure):
    """``struct __user_cap_header_struct { __u32 version; int pid; }``"""
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    """``struct __user_cap_data_struct { __u32 effective, permitted, inheritable; }``"""
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, call: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


def names(mask: int) -> list:
    by_bit = {b: n for n, b in CAPS.items()}
    return [by_bit.get(b, f"cap{b}") for b in range(64) if mask >> b & 1]


def mask_of(caps) -> int:
    m = 0
    for c in caps:
        m |= 1 << CAPS[c]
    return m


# capture.tls: uprobes are attached to libssl files found after start (the
# dlopen ring, a reload), which takes CAP_PERFMON (a uprobe perf event).
KEEP_WITH_TLS = ("CAP_PERFMON",)


def kept(permitted: int, tls: bool = False) -> int:
    """The capabilities of permitted that stay after attach."""
    keep = permitted & mask_of(KEEP + (KEEP_WITH_TLS if tls else ()))
    if keep & mask_of(("CAP_SYS_ADMIN",)):
        keep |= permitted & mask_of(KEEP_WITH_SYS_ADMIN)
    return keep


def loads_after_drop() -> bool:
    """Can this process still load BPF programs once drop_after_attach has
    run (CAP_SYS_ADMIN kept)? Then what no config asks for yet (capture.dns)
    can be loaded when one does, rather than at start."""
    try:
        permitted = current()[1]
    except OSError:
        return False
    return bool(kept(permitted) & mask_of(("CAP_SYS_ADMIN",)))


def current() -> tuple:
    """(effective, permitted, inheritable) of this thread, as 64-bit masks."""
    hdr, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    _check(_libc().capget(ctypes.byref(hdr), data), "capget")
    return tuple(getattr(data[0], f) | getattr(data[1], f) << 32
                 for f in ("effective", "permitted", "inheritable"))


def threads(pid="self") -> dict:
    """{tid: (CapEff, NoNewPrivs)} of every thread of a process, as the kernel
    has them (/proc/PID/task/TID/status): Python's thread list misses threads
    that C code started."""
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/status") as f:
                st = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):    # the thread ended meanwhile (a dying
            continue                                        # one's status: ESRCH)
        out[int(tid)] = (int(st["CapEff"], 16), int(st.get("NoNewPrivs", "0")))
    return out


# How long a thread that is not a running Python thread may take to end: a
# Python thread that join() has returned for still exits in the kernel for a
# moment (its state is released first), and a start that had just joined the
# threads it imported and probed with once saw one (CI, 2026-12-05).
EXIT_GRACE = 0.5


def _privileged_threads(keep: int) -> dict:
    """{tid: CapEff} of the other threads holding more than keep, or
    without no_new_privs; threads that are ending are waited for."""
    deadline = time.monotonic() + EXIT_GRACE
    while True:
        more = {tid: eff for tid, (eff, nnp) in threads().items() if eff & ~keep or not nnp}
        running = {t.native_id for t in threading.enumerate()}
        if not more or more.keys() & running or time.monotonic() > deadline:
            return more
        time.sleep(0.002)


def drop_after_attach(tls: bool = False) -> int:
    """Keep only :func:`kept` capabilities, set no_new_privs; returns the
    mask kept. Raises OSError if the kernel refuses (nothing is half-done:
    capset is one call), or if another thread of the process still holds
    more afterwards: capset and prctl change the calling thread only, so
    the drop must come before any other thread starts (every later thread
    inherits the dropped set from the thread that starts it)."""
    libc = _libc()
    _, permitted, _ = current()
    keep = kept(permitted, tls)
    hdr, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    for i in (0, 1):
        data[i].effective = data[i].permitted = (keep >> (32 * i)) & 0xFFFFFFFF
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    _check(libc.capset(ctypes.byref(hdr), data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    more = _privileged_threads(keep)
    if more:
        names_ = {t.native_id: t.name for t in threading.enumerate()}
        raise OSError(errno.EPERM, "threads started before the drop keep their capabilities: " + ", ".join(
            f"{tid} ({names_.get(tid, 'not a Python thread')}: {', '.join(names(eff & ~keep)) or 'no_new_privs unset'})"
            for tid, eff in sorted(more.items())))
    log.info("privileges: after attach keeping %s; no_new_privs set",
             ", ".join(names(keep)) or "no capability")
    return keep
