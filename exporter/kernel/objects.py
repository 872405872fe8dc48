"""A libbpf object's programs and maps before and after load: the loader's
configuration of an opened object (which programs load, which maps are
created and how), and destroying links, shared by the loader
(exporter/kernel/loader.py) and the DNS programs it loads later
(exporter/kernel/dns.py)."""
from __future__ import annotations

import ctypes
import os
import threading

from exporter.kernel import features, libbpf, privileges
from exporter.kernel.programs_h import MAPS

BPF_MAP_TYPE_HASH = 1
# From the maps' NETTAP_MAP tags (bpf/maps.bpf.h, conn.bpf.h say why each):
# max_entries of maps that must be preallocated before Linux 6.1 (features.py:
# bpf_mem_alloc); the maps preallocated on every kernel; and the maps only one
# variant's programs use, not created for the other (task storage does not
# exist before Linux 5.11).
PREALLOC_MAX = {n: m[2] for n, m in MAPS.items() if m[2]}
ALWAYS_PREALLOC = tuple(n for n, m in MAPS.items() if m[1])
VARIANT_MAPS = {v: tuple(n for n, m in MAPS.items() if m[0] == v) for v in features.VARIANTS}


def object_programs(obj: int):
    """(name, bpf_program *) of every program of an opened object."""
    prog = libbpf.lib().bpf_object__next_program(obj, None)
    while prog:
        yield libbpf.name_of("bpf_program__name", prog), prog
        prog = libbpf.lib().bpf_object__next_program(obj, prog)


def object_maps(obj: int):
    """(name, bpf_map *) of every map of an opened object."""
    m = libbpf.lib().bpf_object__next_map(obj, None)
    while m:
        yield libbpf.name_of("bpf_map__name", m), m
        m = libbpf.lib().bpf_object__next_map(obj, m)


def configure(obj: int, feats: list, variant: str, want, ring_sizes: dict) -> None:
    """Before load: autoload only the programs in want, create only the
    variant's maps, preallocate hash maps where the kernel needs it, and
    write what the kernel offers into .rodata.nettap."""
    lb = libbpf.lib()
    for name, prog in object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, name in want)
    unused = {m for v, maps in VARIANT_MAPS.items() if v != variant for m in maps}
    settings = features.kernel_settings(feats)
    prealloc = not features.runtime_alloc_ok(feats)
    for name, m in object_maps(obj):
        if (prealloc or name in ALWAYS_PREALLOC) and lb.bpf_map__type(m) == BPF_MAP_TYPE_HASH \
                and lb.bpf_map__map_flags(m) & 1:
            # Before 6.1: preallocate (see features.py), and keep the
            # per-thread call table small, as it is then paid in full.
            libbpf.call("bpf_map__set_map_flags", m, lb.bpf_map__map_flags(m) & ~1)
            if name in PREALLOC_MAX:
                libbpf.call("bpf_map__set_max_entries", m, PREALLOC_MAX[name])
        if name in unused:
            libbpf.call("bpf_map__set_autocreate", m, False)
        if name.endswith(".rodata.nettap"):
            libbpf.call("bpf_map__set_initial_value", m, settings, len(settings))
        if name in ring_sizes:
            libbpf.call("bpf_map__set_max_entries", m, ring_sizes[name])


VMLINUX_BTF = "/sys/kernel/btf/vmlinux"


def open_object(path: str) -> int:
    """bpf_object__open_file, with vmlinux's BTF as the CO-RE target where
    this process may not list the kernel's BTF objects. A type vmlinux lacks
    (a newer kernel's: struct numa_drop_counters, which the request programs
    read where it exists) libbpf also looks for in the modules' BTF, and
    listing those (BPF_BTF_GET_NEXT_ID) needs CAP_SYS_ADMIN: without it
    libbpf 1.1 fails the whole load ("failed to iterate BTF objects"), for a
    subprogram too, which it relocates whichever programs load. With
    btf_custom_path it looks in vmlinux's alone (every type nettap reads is
    vmlinux's), parsing that BTF once more per object (~6 ms here)."""
    opts = None
    if not privileges.current()[0] & privileges.mask_of(("CAP_SYS_ADMIN",)) and os.path.exists(VMLINUX_BTF):
        opts = libbpf.bpf_object_open_opts(sz=ctypes.sizeof(libbpf.bpf_object_open_opts),
                                           btf_custom_path=VMLINUX_BTF.encode())
    return libbpf.call_ptr("bpf_object__open_file", path.encode(), ctypes.byref(opts) if opts else None)


def destroy_links(links) -> None:
    """Destroy libbpf links, all at once.

    Detaching waits for the kernel: a tracepoint's perf event waits out an
    RCU grace period as it unregisters (kernel/trace/trace_event_perf.c:
    perf_trace_event_unreg -> tracepoint_synchronize_unregister), a
    kprobe's and a trampoline's alike. One after another, 18 links took
    0.6 s here (~10x that in an emulated guest); destroyed from a thread
    each, the waits overlap: 0.065 s. ctypes releases the interpreter lock
    around each call, and each link is its own (libbpf shares no state
    between them). links: bpf_link * (ints), or uprobe_multi.Link."""
    lib = libbpf.lib()

    def destroy(link) -> None:
        if isinstance(link, int):
            lib.bpf_link__destroy(link)
        else:
            link.close()
    if len(links) < 2:
        for link in links:
            destroy(link)
        return
    threads = [threading.Thread(target=destroy, args=(link,), name="nettap-detach") for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
