"""A thin, typed ctypes binding over the system libbpf (``libbpf.so.1``).

Only signatures live here: every function that returns a pointer declares
``restype = c_void_p`` (a plain ``c_int`` would truncate 64-bit pointers), and
the library is loaded lazily with ``use_errno=True``. Failures are raised as
:class:`OSError` carrying the errno and the name of the libbpf call, the way
libbpf itself reports them (negative errno returns, or NULL plus ``errno``).

Nothing here holds state except the loaded library handle.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import os
from ctypes import (POINTER, Structure, c_bool, c_char_p, c_int, c_size_t,
                    c_uint32, c_uint64, c_void_p)

LIBBPF_NAME = "libbpf.so.1"

# enum bpf_prog_type / bpf_attach_type / bpf_stats_type (uapi/linux/bpf.h)
BPF_PROG_TYPE_SOCKET_FILTER = 1
BPF_PROG_TYPE_TRACING = 26
BPF_TRACE_FENTRY = 24
BPF_TRACE_FEXIT = 25
BPF_STATS_RUN_TIME = 0
# enum btf_kind (uapi/linux/btf.h)
BTF_KIND_FUNC = 12
# bpf_map_update_elem flags
BPF_ANY = 0

_lib: ctypes.CDLL | None = None


class bpf_prog_load_opts(Structure):
    """``struct bpf_prog_load_opts`` of libbpf 1.x (bpf/bpf.h), up to the
    fields nettap sets; ``sz`` tells libbpf how much of it we pass."""

    _fields_ = [
        ("sz", c_size_t),
        ("attempts", c_int),
        ("expected_attach_type", c_uint32),
        ("prog_btf_fd", c_uint32),
        ("prog_flags", c_uint32),
        ("prog_ifindex", c_uint32),
        ("kern_version", c_uint32),
        ("attach_btf_id", c_uint32),
        ("attach_prog_fd", c_uint32),
        ("attach_btf_obj_fd", c_uint32),
    ]


class bpf_object_open_opts(Structure):
    """``struct bpf_object_open_opts`` of libbpf 1.1 (bpf/libbpf.h), up to
    ``kernel_log_level``; ``sz`` tells libbpf how much of it we pass."""

    _fields_ = [
        ("sz", c_size_t),
        ("object_name", c_char_p),
        ("relaxed_maps", c_bool),
        ("pin_root_path", c_char_p),
        ("_attach_prog_fd", c_uint32),          # __u32 :32, the removed attach_prog_fd
        ("kconfig", c_char_p),
        ("btf_custom_path", c_char_p),
        ("kernel_log_buf", c_char_p),
        ("kernel_log_size", c_size_t),
        ("kernel_log_level", c_uint32),
    ]


class bpf_test_run_opts(Structure):
    """``struct bpf_test_run_opts`` of libbpf (bpf/bpf.h), up to ``duration``."""

    _fields_ = [
        ("sz", c_size_t),
        ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
        ("data_size_in", c_uint32), ("data_size_out", c_uint32),
        ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", c_uint32), ("ctx_size_out", c_uint32),
        ("retval", c_uint32), ("repeat", c_int), ("duration", c_uint32),
    ]


# name: (restype, argtypes). Pointer results are c_void_p, always.
_SIGNATURES = {
    "libbpf_version_string": (c_char_p, []),
    "libbpf_num_possible_cpus": (c_int, []),
    "bpf_object__open_file": (c_void_p, [c_char_p, c_void_p]),
    "bpf_object__load": (c_int, [c_void_p]),
    "bpf_object__close": (None, [c_void_p]),
    "bpf_object__next_program": (c_void_p, [c_void_p, c_void_p]),
    "bpf_object__find_program_by_name": (c_void_p, [c_void_p, c_char_p]),
    "bpf_object__next_map": (c_void_p, [c_void_p, c_void_p]),
    "bpf_object__find_map_by_name": (c_void_p, [c_void_p, c_char_p]),
    "bpf_program__name": (c_char_p, [c_void_p]),
    "bpf_program__section_name": (c_char_p, [c_void_p]),
    "bpf_program__set_autoload": (c_int, [c_void_p, c_bool]),
    "bpf_program__autoload": (c_bool, [c_void_p]),
    "bpf_program__fd": (c_int, [c_void_p]),
    "bpf_program__set_expected_attach_type": (c_int, [c_void_p, c_uint32]),
    "bpf_program__attach": (c_void_p, [c_void_p]),
    "bpf_program__attach_tracepoint": (c_void_p, [c_void_p, c_char_p, c_char_p]),
    "bpf_program__attach_kprobe": (c_void_p, [c_void_p, c_bool, c_char_p]),
    "bpf_program__set_attach_target": (c_int, [c_void_p, c_int, c_char_p]),
    "bpf_link__destroy": (c_int, [c_void_p]),
    "bpf_link__fd": (c_int, [c_void_p]),
    "bpf_program__attach_iter": (c_void_p, [c_void_p, c_void_p]),
    "bpf_iter_create": (c_int, [c_int]),
    "bpf_map__name": (c_char_p, [c_void_p]),
    "bpf_map__fd": (c_int, [c_void_p]),
    "bpf_map__type": (c_int, [c_void_p]),
    "bpf_map__key_size": (c_uint32, [c_void_p]),
    "bpf_map__value_size": (c_uint32, [c_void_p]),
    "bpf_map__max_entries": (c_uint32, [c_void_p]),
    "bpf_map__set_max_entries": (c_int, [c_void_p, c_uint32]),
    "bpf_map__set_autocreate": (c_int, [c_void_p, c_bool]),
    "bpf_map__map_flags": (c_uint32, [c_void_p]),
    "bpf_map__set_map_flags": (c_int, [c_void_p, c_uint32]),
    "bpf_map__set_initial_value": (c_int, [c_void_p, c_void_p, c_size_t]),
    "bpf_map__autocreate": (c_bool, [c_void_p]),
    "bpf_map__reuse_fd": (c_int, [c_void_p, c_int]),
    "libbpf_probe_bpf_map_type": (c_int, [c_int, c_void_p]),
    "libbpf_probe_bpf_helper": (c_int, [c_int, c_int, c_void_p]),
    "bpf_map_update_elem": (c_int, [c_int, c_void_p, c_void_p, c_uint64]),
    "bpf_map_lookup_elem": (c_int, [c_int, c_void_p, c_void_p]),
    "bpf_map_delete_elem": (c_int, [c_int, c_void_p]),
    "bpf_map_get_next_key": (c_int, [c_int, c_void_p, c_void_p]),
    "bpf_obj_get_info_by_fd": (c_int, [c_int, c_void_p, POINTER(c_uint32)]),
    "bpf_enable_stats": (c_int, [c_int]),
    "bpf_prog_load": (c_int, [c_int, c_char_p, c_char_p, c_void_p, c_size_t, c_void_p]),
    "bpf_raw_tracepoint_open": (c_int, [c_char_p, c_int]),
    "bpf_prog_test_run_opts": (c_int, [c_int, c_void_p]),
    "bpf_prog_get_next_id": (c_int, [c_uint32, POINTER(c_uint32)]),
    "bpf_prog_get_fd_by_id": (c_int, [c_uint32]),
    "btf__load_vmlinux_btf": (c_void_p, []),
    "btf__find_by_name_kind": (c_int, [c_void_p, c_char_p, c_uint32]),
    "btf__free": (None, [c_void_p]),
    "btf__load_from_kernel_by_id": (c_void_p, [c_uint32]),
    "btf__type_by_id": (c_void_p, [c_void_p, c_uint32]),
    "btf__name_by_offset": (c_char_p, [c_void_p, c_uint32]),
}


def lib() -> ctypes.CDLL:
    """The libbpf handle, loaded and typed on first use."""
    global _lib
    if _lib is None:
        handle = ctypes.CDLL(LIBBPF_NAME, use_errno=True)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = handle
    return _lib


def _raise(call: str, err: int) -> None:
    err = abs(err) or _errno.EIO
    raise OSError(err, f"{call}: {os.strerror(err)}")


def check(call: str, ret: int) -> int:
    """Raise for libbpf's negative-errno convention; return ret otherwise."""
    if ret < 0:
        _raise(call, ret)
    return ret


def check_ptr(call: str, ptr: int | None) -> int:
    """Raise for libbpf's NULL-plus-errno convention; return the pointer."""
    if not ptr:
        _raise(call, ctypes.get_errno())
    return ptr


def call(name: str, *args):
    """Call a libbpf function that returns a negative errno on failure."""
    return check(name, getattr(lib(), name)(*args))


def call_ptr(name: str, *args) -> int:
    """Call a libbpf function that returns a pointer, NULL on failure."""
    ctypes.set_errno(0)
    return check_ptr(name, getattr(lib(), name)(*args))


def name_of(fn: str, ptr: int) -> str:
    """bpf_program__name / bpf_map__name as str."""
    return getattr(lib(), fn)(ptr).decode()


def version() -> str:
    """libbpf's version, e.g. 'v1.1'."""
    return lib().libbpf_version_string().decode()


def possible_cpus() -> int:
    return call("libbpf_num_possible_cpus")
