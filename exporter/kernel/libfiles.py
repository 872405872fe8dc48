"""The library files processes map, found in /proc/PID/maps and opened
without trusting the path any user can plant (tls.py attaches to them).

A map line's path is the kernel's d_path of the mapped file *as the reader
sees it* (nettap's root), while /proc/PID/root + path resolves it in the
process's root: a process that maps R/lib/libssl.so.3 and then chroots to R
(``unshare -Ur`` gives any user the right) makes nettap resolve
R/R/lib/libssl.so.3, a name the user owns: a FIFO (open() blocks for
ever), a symlink to a root-only file, anything. So a mapped file is never
opened by its path. It is opened through /proc/PID/map_files/START-END, the
kernel's own reference to the mapping's file (the file the process
mapped, which it had open for reading to map it): no name is resolved, and
a FIFO or a device cannot be mapped. The open is O_PATH (no driver's or
file system's open runs) and only a regular file is taken; tls.py then
hands libbpf and the kernel /proc/self/fd/N, that same file.

map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE). Without it the
path is resolved in the process's root with openat2 (RESOLVE_IN_ROOT,
no symlinks, no magic links; before 5.6 O_NOFOLLOW on the last name), O_PATH,
and the file is taken only if its (device, inode) is the map line's, which
the kernel wrote from the real mapping: whatever a user plants there is
another inode, refused. (On overlayfs before 5.19-ish kernels the line
names the layer's inode and the path the overlay's: such a file is refused
on this path, and found through map_files where nettap has the capability.)
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from typing import NamedTuple

O_FLAGS = os.O_PATH | os.O_CLOEXEC
# include/uapi/linux/openat2.h
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_IN_ROOT = 0x02, 0x04, 0x10
SYS_OPENAT2 = 437                   # the same on x86-64 and arm64 (asm-generic)


class Refused(Exception):
    """A file not taken; reason is one of tls.REASONS."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


class MapLine(NamedTuple):
    pid: int
    range: str          # START-END: its name in /proc/PID/map_files
    dev: int            # os.makedev of the line's MAJOR:MINOR
    ino: int
    path: str           # as the kernel printed it, without " (deleted)"

    @property
    def key(self) -> tuple:
        """The mapped file as the kernel names it: (device, inode)."""
        return (self.dev, self.ino)


def map_lines(data: bytes, pid: int, want) -> list:
    """The lines of one /proc/PID/maps whose path want(path) accepts, one per
    file (a file has several mappings)."""
    out = {}
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].removesuffix(" (deleted)")
        if not want(path):
            continue
        try:
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            # maps pads addresses to 8 digits; map_files names them "%lx-%lx" (a
            # non-PIE executable's 00400000 is map_files/400000-...)
            span = "-".join(f"{int(x, 16):x}" for x in parts[0].split("-"))
            ml = MapLine(pid, span, os.makedev(major, minor), int(parts[4]), path)
        except ValueError:
            continue
        out.setdefault(ml.key, ml)
    return list(out.values())


def read_maps(proc: str, pid) -> bytes:
    try:
        with open(os.path.join(proc, str(pid), "maps"), "rb") as f:
            return f.read()
    except OSError:                     # gone, or a kernel thread
        return b""


def fs_type(proc: str, pid: int, dev: int) -> str:
    """The file system type of the mount of device dev in pid's mount
    namespace (its mountinfo, which names no file system call), "" unknown."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(os.path.join(proc, str(pid), "mountinfo"), "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return ""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2); OSError(ENOSYS) before Linux 5.6."""
    how = _OpenHow(flags=flags, mode=0, resolve=resolve)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"openat2: {os.strerror(e)}", path)
    return fd


def _regular(fd: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused("not_regular", f"{what}: not a regular file")
    return st


def _in_root(line: MapLine, proc: str) -> int:
    """An O_PATH fd of line's path resolved in its process's root, no link followed."""
    root = os.open(os.path.join(proc, str(line.pid), "root"), O_FLAGS | os.O_DIRECTORY)
    try:
        try:
            return openat2(root, line.path, O_FLAGS, RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno != errno.ENOSYS:
                raise
        return os.open(line.path.lstrip("/"), O_FLAGS | os.O_NOFOLLOW, dir_fd=root)
    finally:
        os.close(root)


def open_mapped(line: MapLine, proc: str = "/proc", map_files: bool = True) -> tuple:
    """(an O_PATH fd of the file line's process maps, its fstat); Refused
    when it is not a regular file, or is not provably the mapped file."""
    what = f"{line.path} (pid {line.pid})"
    fd = -1
    try:
        if map_files:
            try:
                fd = os.open(os.path.join(proc, str(line.pid), "map_files", line.range), O_FLAGS)
            except PermissionError:         # no CAP_SYS_ADMIN: the path, checked
                pass
        if fd < 0:
            fd = _in_root(line, proc)
            st = _regular(fd, what)
            if (st.st_dev, st.st_ino) != line.key:
                raise Refused("not_mapped", f"{what}: the path names another file than the one mapped")
        else:
            st = _regular(fd, what)
    except FileNotFoundError:
        raise Refused("gone", f"{what}: unmapped, or the process is gone") from None
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        raise Refused("not_mapped", f"{what}: {e.strerror}") from None
    except Refused:
        if fd >= 0:
            os.close(fd)
        raise
    return fd, st


def open_system(directory: str, name: str) -> tuple:
    """(an O_PATH fd, fstat) of a file of the linker's directories, not
    following a symlink (the file it names is taken where it is found)."""
    fd = os.open(os.path.join(directory, name), O_FLAGS | os.O_NOFOLLOW)
    try:
        return fd, _regular(fd, os.path.join(directory, name))
    except Refused:
        os.close(fd)
        raise
