"""uprobe_multi links (Linux 6.6+): every uprobe of one program on one file
in one link, made by the raw ``BPF_LINK_CREATE`` (libbpf 1.1 has no call
for them), and the file offsets of its symbols (pyelftools).

Why: a perf-event uprobe is detached on its own, holding event_mutex
across the kernel's grace-period waits (~100 ms each, one after another
whatever the threads); a uprobe_multi link's release
(kernel/trace/bpf_trace.c: bpf_uprobe_multi_link_release ->
bpf_uprobe_unregister) unregisters all of its uprobes with one sync and
takes no event_mutex, so links closed from threads wait side by side.
16 copies of libssl.so.3, 12 uprobes each, on 6.18: 192 perf-event links
closed in 19.3 s (serially or from 8 threads alike), 144 multi links in
6.5 s serially and 1.2 s from 8 threads.
"""
from __future__ import annotations

import ctypes
import errno
import os
from ctypes import Structure, Union, c_uint32, c_uint64

from exporter.kernel import arch, libbpf

BPF_LINK_CREATE = 28
BPF_PROG_LOAD = 5
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48        # enum bpf_attach_type
BPF_F_UPROBE_MULTI_RETURN = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class uprobe_multi_attr(Structure):
    """``link_create.uprobe_multi`` of ``union bpf_attr``
    (include/uapi/linux/bpf.h, 6.6+)::

        struct {
            __aligned_u64 path;
            __aligned_u64 offsets;
            __aligned_u64 ref_ctr_offsets;
            __aligned_u64 cookies;
            __u32 cnt;
            __u32 flags;
            __u32 pid;
        } uprobe_multi;
    """

    _fields_ = [("path", c_uint64), ("offsets", c_uint64), ("ref_ctr_offsets", c_uint64),
                ("cookies", c_uint64), ("cnt", c_uint32), ("flags", c_uint32), ("pid", c_uint32)]


class _target(Union):
    _fields_ = [("uprobe_multi", uprobe_multi_attr), ("_pad", ctypes.c_uint8 * 112)]


class link_create_attr(Structure):
    """``link_create`` of ``union bpf_attr`` (include/uapi/linux/bpf.h)::

        struct { /* struct used by BPF_LINK_CREATE command */
            union {
                __u32 prog_fd;      /* eBPF program to attach */
                __u32 map_fd;       /* struct_ops to attach */
            };
            union {
                __u32 target_fd;    /* target object to attach to or ... */
                __u32 target_ifindex; /* target ifindex */
            };
            __u32 attach_type;      /* attach type */
            __u32 flags;            /* extra flags */
            union {
                ...
                struct { ... } uprobe_multi;
                ...
            };
        } link_create;

    (the union padded to the size of ``union bpf_attr``'s largest member
    as this kernel sees it: the kernel checks the bytes past what it knows
    are zero.)"""

    _fields_ = [("prog_fd", c_uint32), ("target_fd", c_uint32), ("attach_type", c_uint32),
                ("flags", c_uint32), ("u", _target)]


def _bpf(cmd: int, attr, what: str) -> int:
    ctypes.set_errno(0)
    r = _libc.syscall(arch.syscall_nr("bpf"), cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return r


class Link:
    """A raw link fd, destroyed as libbpf's links are (objects.destroy_links)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def link(prog_fd: int, path: str, offsets: list, retprobe: bool) -> int:
    """A uprobe_multi link (a Link) of the program on the file offsets of the
    file at path, in every process; OSError(errno, "BPF_LINK_CREATE ...")."""
    p = ctypes.create_string_buffer(os.fsencode(path))
    offs = (c_uint64 * len(offsets))(*offsets)
    attr = link_create_attr(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI)
    um = attr.u.uprobe_multi
    um.path, um.offsets, um.cnt = ctypes.addressof(p), ctypes.addressof(offs), len(offsets)
    um.flags = BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    return Link(_bpf(BPF_LINK_CREATE, attr, f"BPF_LINK_CREATE(uprobe_multi, {path})"))


class _prog_load_attr(Structure):
    """``union bpf_attr``'s BPF_PROG_LOAD part, to expected_attach_type."""

    _fields_ = [("prog_type", c_uint32), ("insn_cnt", c_uint32), ("insns", c_uint64), ("license", c_uint64),
                ("log_level", c_uint32), ("log_size", c_uint32), ("log_buf", c_uint64),
                ("kern_version", c_uint32), ("prog_flags", c_uint32), ("prog_name", ctypes.c_char * 16),
                ("prog_ifindex", c_uint32), ("expected_attach_type", c_uint32), ("_pad", ctypes.c_uint8 * 72)]


def supported() -> tuple:
    """(present, how): a kprobe program loaded for uprobe_multi, linked to
    "/" (not a regular file): EBADF where the kernel has uprobe_multi links,
    EINVAL (an attach type it does not know) where not. libbpf's own probe."""
    insns = (c_uint64 * 2)(0xb7, 0x95)          # r0 = 0; exit
    lic = ctypes.create_string_buffer(b"GPL")
    attr = _prog_load_attr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=2, insns=ctypes.addressof(insns),
                           license=ctypes.addressof(lic), expected_attach_type=BPF_TRACE_UPROBE_MULTI)
    try:
        fd = _bpf(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")
    except OSError as e:
        return False, f"a uprobe_multi program: {e.strerror}"
    try:
        link(fd, "/", [0], False).close()
    except OSError as e:
        return e.errno == errno.EBADF, "BPF_LINK_CREATE(uprobe_multi)"
    finally:
        os.close(fd)
    return False, "BPF_LINK_CREATE(uprobe_multi) linked a directory"


def symbol_offsets(path: str, names) -> dict:
    """name -> file offset of each function of names the ELF file at path
    defines (.dynsym, then .symtab): its address turned into an offset
    through the LOAD segment holding it, as libbpf's elf_find_func_offset."""
    from elftools.elf.elffile import ELFFile      # imported by a TLS attach only
    want, found = set(names), {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        segs = [s.header for s in elf.iter_segments() if s.header.p_type == "PT_LOAD"]
        for sec_name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(sec_name)
            if sec is None:
                continue
            for sym in sec.iter_symbols():
                name = sym.name.split("@")[0]
                e = sym.entry
                if name not in want or name in found or e.st_info.type not in ("STT_FUNC", "STT_GNU_IFUNC") \
                        or e.st_shndx == "SHN_UNDEF" or not e.st_value:
                    continue
                for h in segs:
                    if h.p_vaddr <= e.st_value < h.p_vaddr + h.p_memsz:
                        found[name] = e.st_value - h.p_vaddr + h.p_offset
                        break
    return found


def prog_fd(prog: int) -> int:
    """The fd of a loaded bpf_program *."""
    return libbpf.call("bpf_program__fd", prog)
