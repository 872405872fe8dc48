"""The machines nettap has BPF objects for, and the start's refusal of any
other, by name.

An object runs only on the architecture it was built for: bpf/Makefile
compiles with ``-D__TARGET_ARCH_<arch>`` (``uname -m`` of the build host),
which chooses the ``struct pt_regs`` a kprobe's arguments are read from
(libbpf's bpf_tracing.h, ``PT_REGS_PARM*``) and the syscall wrappers'
calling convention. The objects committed in bpf/ are built for x86-64 alone,
so :func:`target` refuses every other machine before anything is loaded
(mechanisms.plan asks it first); the ring reader itself is portable
(exporter/capture/ringbuf.py, "Memory ordering").
"""
from __future__ import annotations

import platform

from exporter.kernel.features import Unsupported

# uname -m -> bpf/Makefile's __TARGET_ARCH_ name, for each machine bpf/*.bpf.o are built for.
OBJECTS = {"x86_64": "x86"}


def target(machine: str | None = None) -> str:
    """The objects' target architecture for machine (default: this one's
    ``uname -m``); Unsupported, naming it and the machines nettap has objects
    for, when there are none."""
    machine = machine or platform.machine()
    if machine not in OBJECTS:
        raise Unsupported(f"machine {machine or 'unknown'}: nettap has BPF objects only for "
                          f"{', '.join(OBJECTS)} (bpf/*.bpf.o are built per architecture)")
    return OBJECTS[machine]
