"""Opening nettap's files without trusting their paths: the output file
(:func:`open_dir`, :func:`open_file`), a file given to read
(:func:`open_regular`: config, web config, certificates, captures) and a file
given to write (:func:`create_for_writing`: `nettap read --pcap`).

nettap runs as root and writes captured traffic, so nothing in the output
path that another user could have put there is trusted: the directory is
reached from / one component at a time without following a link, a
directory another user could swap files in is refused, the file is opened
relative to that checked directory without following a link, and a file
nettap does not own, that others may write, or that has a second name is
refused. Every refusal is an :class:`OutputRefused` naming the file and why.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Tuple


class OutputRefused(OSError):
    """The output path is unsafe or unusable; str() names the file and why."""

    def __init__(self, message: str, err: int = errno.EPERM):
        super().__init__(err, message)
        self.message = message
        self.logged = False

    def __str__(self) -> str:
        return self.message


_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_RDWR: the last byte of an existing file is read (a cut last line).
# O_NONBLOCK: opening a FIFO or a device must not hang; it is refused next.
_FILE_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _check_dir(fd: int, shown: str, uid: int) -> None:
    st = os.fstat(fd)
    if st.st_uid not in (0, uid):
        raise OutputRefused(f"directory {shown} is owned by uid {st.st_uid}, neither root nor nettap's uid "
                            f"{uid}: its owner could swap the output file for a link or a file of theirs")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OutputRefused(f"directory {shown} is world-writable without the sticky bit: any user could "
                            "swap the output file for a link or a file of theirs")


def open_dir(path: str, create: bool, uid: int) -> int:
    """An O_PATH fd of directory ``path``, reached from / one component at a
    time, none followed if it is a link, each checked (owner root or nettap's
    user; not world-writable unless sticky). Links in ``path`` are resolved
    first (realpath): one an admin made (/var/run -> /run) is taken, one
    planted in an unchecked directory after that is refused. Missing
    components are made (0755) when ``create``. uid: nettap's user."""
    real = os.path.realpath(path)
    fd = os.open("/", _DIR_FLAGS)
    shown = "/"
    try:
        _check_dir(fd, shown, uid)
        for part in real.split("/"):
            if not part:
                continue
            shown = os.path.join(shown, part)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise OutputRefused(f"directory {shown} does not exist", errno.ENOENT) from None
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise OutputRefused(f"cannot create directory {shown}: {e.strerror}", e.errno) from None
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise OutputRefused(f"{shown} is not a directory (or is a link made after the path "
                                        "was resolved)", e.errno) from None
                raise OutputRefused(f"cannot open directory {shown}: {e.strerror}", e.errno) from None
            os.close(fd)
            fd = nfd
            _check_dir(fd, shown, uid)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refused(st: os.stat_result, uid: int) -> str:
    """Why an output file that stat describes is refused ("" when it is not)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not nettap's uid {uid}: its owner could read the captured traffic"
    if st.st_mode & 0o022:
        return (f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}): others could alter "
                "the capture")
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links: it may be another file under a second name"
    return ""


def open_file(dir_fd: int, name: str, shown: str, mode: int, uid: int) -> Tuple[int, os.stat_result]:
    """Open (create with ``mode``) ``name`` in the checked directory for
    appending, without following a link; refuse what another user could
    have planted or may read or alter."""
    try:
        fd = os.open(name, _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputRefused(f"{shown} is a symbolic link: nettap does not follow links for its output",
                                e.errno) from None
        raise OutputRefused(f"cannot open {shown}: {e.strerror}", e.errno) from None
    try:
        st = os.fstat(fd)
        why = _refused(st, uid)
        if why:
            raise OutputRefused(f"{shown} {why}")
        if stat.S_IMODE(st.st_mode) != mode:        # also undoes the umask on a new file
            os.fchmod(fd, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str) -> int:
    """A read-only fd of path, which must be a regular file (OSError
    otherwise). O_NONBLOCK: a FIFO put where a file is expected must not
    hang the open, and is refused by the fstat after it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                          os.strerror(errno.EISDIR) if stat.S_ISDIR(mode) else "not a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


def create_for_writing(path: str) -> int:
    """A write fd of path, emptied: a regular file owned by this user with
    one link, never a link followed at the last component (`nettap read
    --pcap` runs as root, and `--pcap /tmp/x` may meet a link another user planted
    there) and never a FIFO waited on. OSError otherwise."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | os.O_NOCTTY, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "it is a symbolic link: nettap does not follow links for what it writes") from None
        if e.errno == errno.ENXIO:                  # a FIFO nobody reads
            raise OSError(e.errno, "not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"owned by uid {st.st_uid}, not this user's {os.geteuid()}"
        elif st.st_nlink != 1:
            why = f"it has {st.st_nlink} hard links: it may be another file under a second name"
        if why:
            raise OSError(errno.EPERM, why)
        os.ftruncate(fd, 0)                         # only now: what was refused stays whole
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check(path: str, mode: int, uid: int) -> None:
    """What opening ``path`` as the output would meet, without leaving a
    trace (``--check-config``): the directory walked and checked as
    open_dir does, missing directories and the file made as the daemon
    would make them, then removed again; an existing file checked as
    open_file checks it, and left as it was. OutputRefused otherwise."""
    dirpath, name = os.path.split(os.path.abspath(path))
    made = []
    real = os.path.realpath(dirpath)
    probe = real
    while probe != "/" and not os.path.lexists(probe):
        made.append(probe)
        probe = os.path.dirname(probe)
    fd = None
    try:
        fd = open_dir(dirpath, True, uid)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None:                               # as the daemon would: made, then removed
            nfd, _ = open_file(fd, name, path, mode, uid)
            os.close(nfd)
            os.unlink(name, dir_fd=fd)
            return
        if stat.S_ISLNK(st.st_mode):
            raise OutputRefused(f"{path} is a symbolic link: nettap does not follow links for its output",
                                errno.ELOOP)
        why = _refused(st, uid)
        if not why and (not os.access(name, os.W_OK, dir_fd=fd) or os.statvfs(real).f_flag & os.ST_RDONLY):
            why = "cannot be written (a read-only file system?)"
        if why:
            raise OutputRefused(f"{path} {why}")
    finally:
        if fd is not None:
            os.close(fd)
        for d in made:                               # deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass
