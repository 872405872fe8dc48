"""What the running kernel offers nettap's BPF object, asked of the kernel
itself (libbpf's feature probes, vmlinux BTF, a tiny program load), never
inferred from its version string.

The object carries every program twice (bpf/emit.bpf.h): the *fast*
variant needs every feature below; the *compat* variant only the floor,
vmlinux BTF and BPF ring buffers (Linux 5.8). :func:`probe` finds what is
there; :func:`choose_variant` picks the variant, or says which feature is
missing.
"""
from __future__ import annotations

import ctypes
import os

from exporter.kernel import libbpf, uprobe_multi
from exporter.kernel.arch import Unsupported  # noqa: F401  (its home for every caller)

# uapi/linux/bpf.h
BPF_PROG_TYPE_SOCKET_FILTER = 1
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_MAP_TYPE_RINGBUF = 27
BPF_MAP_TYPE_TASK_STORAGE = 29
BPF_FUNC_get_current_ancestor_cgroup_id = 123
BPF_FUNC_get_current_task_btf = 158
BPF_FUNC_loop = 181

BTF_KIND_STRUCT = 4
BTF_KIND_TYPEDEF = 8
VMLINUX_BTF = "/sys/kernel/btf/vmlinux"
VARIANTS = ("fast", "compat")


class Feature:
    """One kernel feature: its name, the Linux release that brought it,
    whether this kernel has it, and how that was found out."""

    def __init__(self, name: str, since: str, present: bool, how: str):
        self.name, self.since, self.present, self.how = name, since, present, how

    def __repr__(self) -> str:
        return f"Feature({self.name!r}, since={self.since!r}, present={self.present})"


# Unsupported: the kernel lacks a feature nettap cannot do without (or the machine is one
# nettap has no BPF objects for). Defined in arch.py, which imports nothing of nettap's, so
# that uprobe_multi.py (imported here) can ask it for syscall numbers.


# name -> (Linux release, required by the compat floor)
FLOOR = ("vmlinux BTF", "BPF ring buffer")
FAST_NEEDS = ("bpf_mem_alloc", "bpf_get_current_ancestor_cgroup_id", "task storage", "bpf_get_current_task_btf",
              "atomic fetch-and-add", "bpf_loop", "bpf_rdonly_cast")


def _map_type(t: int) -> tuple:
    r = libbpf.lib().libbpf_probe_bpf_map_type(t, None)
    return r == 1, "libbpf_probe_bpf_map_type" + ("" if r >= 0 else f": {os.strerror(-r)}")


def helper(prog_type: int, helper: int) -> tuple:
    r = libbpf.lib().libbpf_probe_bpf_helper(prog_type, helper, None)
    return r == 1, "libbpf_probe_bpf_helper" + ("" if r >= 0 else f": {os.strerror(-r)}")


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> int:
    """One struct bpf_insn as a little-endian u64."""
    return (code | (dst | src << 4) << 8 | (off & 0xFFFF) << 16 | (imm & 0xFFFFFFFF) << 32)


def _atomic_fetch() -> tuple:
    """Load a socket filter that does one BPF_ATOMIC | BPF_FETCH add on its
    stack (Linux 5.12, commit 5ca419f2864a "bpf: Add BPF_FETCH field /
    create atomic_fetch_add instruction")."""
    insns = (ctypes.c_uint64 * 6)(
        _insn(0xB7, dst=1),                          # r1 = 0
        _insn(0x7B, dst=10, src=1, off=-8),          # *(u64 *)(r10 - 8) = r1
        _insn(0xB7, dst=2, imm=1),                   # r2 = 1
        _insn(0xDB, dst=10, src=2, off=-8, imm=1),   # r2 = atomic_fetch_add(*(u64 *)(r10 - 8), r2)
        _insn(0xB7, dst=0),                          # r0 = 0
        _insn(0x95))                                 # exit
    fd = libbpf.lib().bpf_prog_load(BPF_PROG_TYPE_SOCKET_FILTER, b"nettap_probe", b"GPL",
                                    insns, 6, None)
    if fd < 0:
        return False, f"test program refused: {os.strerror(-fd)}"
    os.close(fd)
    return True, "test program loaded"


def _kfunc(btf: int, name: str) -> tuple:
    if not btf:
        return False, "no vmlinux BTF"
    found = libbpf.lib().btf__find_by_name_kind(btf, name.encode(), libbpf.BTF_KIND_FUNC) > 0
    return found, "vmlinux BTF"


def _btf_type(btf: int, name: str) -> tuple:
    if not btf:
        return False, "no vmlinux BTF"
    return libbpf.lib().btf__find_by_name_kind(btf, name.encode(), BTF_KIND_STRUCT) > 0, "vmlinux BTF"


def _tracepoint(btf: int, name: str) -> tuple:
    """A BTF raw tracepoint's typedef (libbpf attaches tp_btf/NAME through it)."""
    if not btf:
        return False, "no vmlinux BTF"
    found = libbpf.lib().btf__find_by_name_kind(btf, f"btf_trace_{name}".encode(), BTF_KIND_TYPEDEF) > 0
    return found, "vmlinux BTF"


def probe(btf: int) -> list:
    """Every feature, in the order --preflight prints them. btf: the parsed
    vmlinux BTF (0 if the kernel has none)."""
    has_btf = bool(btf) and os.path.exists(VMLINUX_BTF)
    checks = (
        ("vmlinux BTF", "5.4", lambda: (has_btf, VMLINUX_BTF)),
        ("BPF ring buffer", "5.8", lambda: _map_type(BPF_MAP_TYPE_RINGBUF)),
        # Before 6.1 a hash map allocated at run time in a tracing program is
        # refused on PREEMPT_RT and a kernel WARNING elsewhere (verifier.c's
        # check_map_prog_compatibility); 6.1 gave BPF its own allocator.
        ("bpf_mem_alloc", "6.1", lambda: _btf_type(btf, "bpf_mem_alloc")),
        ("task storage", "5.11", lambda: _map_type(BPF_MAP_TYPE_TASK_STORAGE)),
        # compat reads the cgroup ancestry itself where tracing programs lack the helper
        ("bpf_get_current_ancestor_cgroup_id", "5.14",
         lambda: helper(BPF_PROG_TYPE_TRACEPOINT, BPF_FUNC_get_current_ancestor_cgroup_id)),
        ("bpf_get_current_task_btf", "5.11",
         lambda: helper(BPF_PROG_TYPE_TRACEPOINT, BPF_FUNC_get_current_task_btf)),
        ("atomic fetch-and-add", "5.12", _atomic_fetch),
        ("bpf_loop", "5.17", lambda: helper(BPF_PROG_TYPE_TRACEPOINT, BPF_FUNC_loop)),
        ("bpf_rdonly_cast", "6.2", lambda: _kfunc(btf, "bpf_rdonly_cast")),
        # a tracepoint a lifecycle program needs (its tag: needs=, bpf/lifecycle.bpf.c)
        ("sock:inet_sk_error_report", "5.14", lambda: _tracepoint(btf, "inet_sk_error_report")),
        # the TLS uprobes, one link per program and file: detached in one wait (uprobe_multi.py)
        ("uprobe_multi", "6.6", uprobe_multi.supported),
    )
    return [Feature(name, since, *check()) for name, since, check in checks]


def kernel_settings(features: list) -> bytes:
    """struct nettap_kernel (bpf/tcp.h), written into the object's
    .rodata.nettap section before load."""
    have = {f.name: f.present for f in features}
    return b"".join(int(have[name]).to_bytes(4, "little")
                    for name in ("bpf_get_current_ancestor_cgroup_id", "bpf_get_current_task_btf", "bpf_loop",
                                 "bpf_mem_alloc"))


def runtime_alloc_ok(features: list) -> bool:
    """May hash maps used by tracing programs allocate at run time
    (BPF_F_NO_PREALLOC)? Else the loader preallocates them."""
    return any(f.name == "bpf_mem_alloc" and f.present for f in features)


def choose_variant(features: list, forced: str | None = None) -> tuple:
    """(variant, why). Raises Unsupported below the floor, or when fast is
    forced on a kernel that cannot run it."""
    have = {f.name: f for f in features}
    release = os.uname().release
    for name in FLOOR:
        if not have[name].present:
            raise Unsupported(f"kernel {release} has no {name} (Linux {have[name].since}+"
                              f"{', built with CONFIG_DEBUG_INFO_BTF' if name == 'vmlinux BTF' else ''});"
                              f" nettap needs it on every kernel")
    missing = [f"{n} (Linux {have[n].since})" for n in FAST_NEEDS if not have[n].present]
    if forced == "compat":
        return "compat", "requested"
    if not missing:
        return "fast", "every feature present"
    if forced == "fast":
        raise Unsupported(f"kernel {release} cannot run the fast programs: no " + ", ".join(missing))
    return "compat", "missing " + ", ".join(missing)
