"""The machines nettap has BPF objects for, where the running machine's
objects are, and the start's refusal of any other machine, by name.

An object runs only on the architecture it was built for: bpf/Makefile
compiles each for every architecture of :data:`OBJECTS` with
``-D__TARGET_ARCH_<arch>``, which chooses the ``struct pt_regs`` a kprobe's
arguments are read from (libbpf's bpf_tracing.h, ``PT_REGS_PARM*``; the frame
is bpf/vmlinux_min.h's), the Go register ABI's registers (bpf/gotls.bpf.c)
and the syscall wrappers' calling convention, into ``bpf/<arch>/``.
:func:`object_path` is the one place that names an object's file;
:func:`target` refuses every other machine before anything is loaded
(mechanisms.plan asks it first); the ring reader itself is portable
(exporter/capture/ringbuf.py, "Memory ordering").
"""
from __future__ import annotations

import os
import platform


class Unsupported(Exception):
    """The kernel lacks a feature nettap cannot do without, or the machine is
    one nettap has no BPF objects for (features.Unsupported: the same class)."""


# uname -m -> bpf/Makefile's __TARGET_ARCH_ name (and bpf/'s directory), for each
# machine bpf/<arch>/*.bpf.o are built for.
OBJECTS = {"x86_64": "x86", "aarch64": "arm64"}


def target(machine: str | None = None) -> str:
    """The objects' target architecture for machine (default: this one's
    ``uname -m``); Unsupported, naming it and the machines nettap has objects
    for, when there are none."""
    machine = machine or platform.machine()
    if machine not in OBJECTS:
        raise Unsupported(f"machine {machine or 'unknown'}: nettap has BPF objects only for "
                          f"{', '.join(OBJECTS)} (bpf/*/*.bpf.o are built per architecture)")
    return OBJECTS[machine]


# The syscalls nettap makes by number (libc wraps none of them), per machine: x86-64's
# arch/x86/entry/syscalls/syscall_64.tbl, arm64's include/uapi/asm-generic/unistd.h.
# (openat2, 437, is the same on both: exporter/kernel/libfiles.py.)
SYSCALLS = {
    "x86_64": {"bpf": 321, "perf_event_open": 298},
    "aarch64": {"bpf": 280, "perf_event_open": 241},
}


def syscall_nr(name: str, machine: str | None = None) -> int:
    """The number of syscall name on machine (default: this one's); Unsupported, as
    :func:`target`, for a machine nettap has no objects for."""
    machine = machine or platform.machine()
    target(machine)
    return SYSCALLS[machine][name]


def _bpf_dir() -> str:
    """The objects shipped inside the installed package (pip install . copies
    bpf/<arch>/*.bpf.o to exporter/bpf/<arch>), else the checkout's bpf/."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # exporter/
    packaged = os.path.join(package, "bpf")
    if any(os.path.isdir(os.path.join(packaged, a)) for a in OBJECTS.values()):
        return packaged
    return os.path.join(os.path.dirname(package), "bpf")


# The directory holding one directory of objects per architecture: $NETTAP_BPF_DIR, else _bpf_dir().
BPF_DIR = os.environ.get("NETTAP_BPF_DIR") or _bpf_dir()


def object_path(name: str, machine: str | None = None, bpf_dir: str | None = None) -> str:
    """The path of object name (``tcp.bpf.o``, ``tcp_open_loop.bpf.o``,
    ``node.bpf.o``) built for machine (default: this one), under bpf_dir
    (default: :data:`BPF_DIR`); Unsupported for a machine without objects."""
    return os.path.join(bpf_dir or BPF_DIR, target(machine), name)
