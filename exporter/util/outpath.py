"""Opening nettap's files without trusting their paths: the output file
(:func:`open_dir`, :func:`open_file`), a file given to read
(:func:`open_regular`: config, web config, certificates, captures) and a file
given to write (:func:`create_for_writing`: `nettap read --pcap`).

nettap runs as root and writes captured traffic, so nothing in the output
path that another user could have put there is trusted: the directory must
resolve inside the configured root (output.root) and is reached from / one
component at a time without following a link (directories are made only
inside the root), a directory another user could swap files in is refused,
a new file is made with O_CREAT|O_EXCL relative to that checked directory,
and an existing one is looked at (O_PATH, no link followed) and refused when
it is not a regular file, nettap does not own it, others may write it, it
has a second name or something is mounted on it, before it is opened for
writing or its mode changed. Every refusal is an :class:`OutputRefused`
naming the file and why.
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
_NEW_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# An existing file: looked at first without opening it (O_PATH: a device or
# a FIFO is not opened, a link is not followed), opened only once checked.
_LOOK_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def inside(root: str, path: str) -> bool:
    """Whether path (absolute, normalized) is root or below it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def under_root(root: str, path: str) -> str:
    """The output file's absolute path: path, relative paths taken from
    root, normalized; ValueError unless it names a file strictly inside root."""
    full = os.path.normpath(os.path.join(root, path))
    if full == os.path.normpath(root) or not inside(os.path.normpath(root), full):
        raise ValueError(full)
    return full


def _check_dir(fd: int, shown: str, uid: int) -> None:
    st = os.fstat(fd)
    if st.st_uid not in (0, uid):
        raise OutputRefused(f"directory {shown} is owned by uid {st.st_uid}, neither root nor nettap's uid "
                            f"{uid}: its owner could swap the output file for a link or a file of theirs")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OutputRefused(f"directory {shown} is world-writable without the sticky bit: any user could "
                            "swap the output file for a link or a file of theirs")


def open_dir(path: str, create: bool, uid: int, root: str | None = None) -> int:
    """An O_PATH fd of directory ``path``, reached from / one component at a
    time, none followed if it is a link, each checked (owner root or nettap's
    user; not world-writable unless sticky). Links in ``path`` are resolved
    first (realpath): one an admin made (/var/run -> /run) is taken, one
    planted in an unchecked directory after that is refused. ``root``: the
    directory it must resolve inside (output.root; None: anywhere). Missing
    components are made (0755) when ``create``, only inside root. uid:
    nettap's user."""
    real = os.path.realpath(path)
    top = os.path.realpath(root) if root else None
    if top is not None and not inside(top, real):
        raise OutputRefused(f"directory {path} resolves to {real}, outside output.root {root}: nettap writes "
                            "only inside its own directory")
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
                if not create or (top is not None and not inside(top, shown)):
                    raise OutputRefused(f"directory {shown} does not exist" + (
                        f" (nettap makes directories only inside output.root {root})" if create else ""),
                        errno.ENOENT) from None
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
        fstype = _fs_type(_mount_id(fd))
        if fstype in _KERNEL_FS:
            raise OutputRefused(f"directory {shown} is on a {fstype} file system: its files are kernel objects "
                                "(a write or a chmod changes the kernel), not nettap's files")
        return fd
    except BaseException:
        os.close(fd)
        raise


# File systems whose files are the kernel's objects or settings, not data.
_KERNEL_FS = frozenset(("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf", "configfs",
                        "devtmpfs", "devpts", "efivarfs", "pstore", "fusectl", "selinuxfs", "binfmt_misc", "nsfs",
                        "mqueue", "hugetlbfs", "rpc_pipefs"))


def _fs_type(mount: int) -> str:
    """The file system type of a mount id (/proc/self/mountinfo); "" if unknown."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                if line.split(b" ", 1)[0] == b"%d" % mount:
                    return line.partition(b" - ")[2].split(b" ", 1)[0].decode("ascii", "replace")
    except OSError:
        pass
    return ""


def _mount_id(fd: int) -> int:
    """The mount fd is on (/proc/self/fdinfo's mnt_id, Linux 3.15); -1 if unknown."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def _look(dir_fd: int, name: str) -> Tuple[os.stat_result, int]:
    """(stat, mount id) of name in dir_fd, without opening it (O_PATH, no link
    followed: a device or a FIFO is not opened). FileNotFoundError if absent."""
    fd = os.open(name, _LOOK_FLAGS, dir_fd=dir_fd)
    try:
        return os.fstat(fd), _mount_id(fd)
    finally:
        os.close(fd)


def _refused(st: os.stat_result, uid: int, mount: int, dir_fd: int) -> str:
    """Why an output file that stat describes, on mount, in the directory
    dir_fd is refused ("" when it is not)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link: nettap does not follow links for its output"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    # By mount id, not st_dev: overlayfs may give a file its layer's st_dev.
    if mount != _mount_id(dir_fd):
        return "is a mount point (a file bind-mounted there): not a file of nettap's directory"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not nettap's uid {uid}: its owner could read the captured traffic"
    if st.st_mode & 0o022:
        return (f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}): others could alter "
                "the capture")
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links: it may be another file under a second name"
    return ""


def open_file(dir_fd: int, name: str, shown: str, mode: int, uid: int) -> Tuple[int, os.stat_result]:
    """Open ``name`` in the checked directory for appending: a new file is
    made (O_EXCL) with ``mode``; an existing one is checked before it is
    opened, and refused, untouched, when another user could have planted it
    or may read or alter it. Its mode is not changed here: set_mode, once the
    caller has accepted it."""
    for _ in range(8):                               # a file removed or made meanwhile: look again
        try:
            fd = os.open(name, _NEW_FLAGS, mode, dir_fd=dir_fd)
        except FileExistsError:
            got = _open_existing(dir_fd, name, shown, uid)
            if got is not None:
                return got
            continue
        except OSError as e:
            raise OutputRefused(f"cannot create {shown}: {e.strerror}", e.errno) from None
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != mode:     # the umask: a file nettap made, so its own to set
                os.fchmod(fd, mode)
            return fd, st
        except BaseException:
            os.close(fd)
            raise
    raise OutputRefused(f"cannot open {shown}: it keeps being removed and made again", errno.EAGAIN)


def _open_existing(dir_fd: int, name: str, shown: str, uid: int):
    """(fd, stat) of the existing file name once checked; None if it is gone."""
    try:
        st, mount = _look(dir_fd, name)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OutputRefused(f"cannot open {shown}: {e.strerror}", e.errno) from None
    why = _refused(st, uid, mount, dir_fd)
    if why:
        raise OutputRefused(f"{shown} {why}", errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EPERM)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OutputRefused(f"cannot open {shown}: {e.strerror}", e.errno) from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or _mount_id(fd) != mount:
            raise OutputRefused(f"{shown} was replaced while it was checked", errno.EAGAIN)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd, now
    except BaseException:
        os.close(fd)
        raise


def set_mode(fd: int, st: os.stat_result, mode: int) -> None:
    """Give an accepted output file ``mode`` (a config change of output.mode)."""
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


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


def check(path: str, mode: int, uid: int, root: str | None = None) -> None:
    """What opening ``path`` as the output would meet, without leaving a
    trace (``--check-config``): the directory walked and checked as
    open_dir does, missing directories (inside root) and the file made as
    the daemon would make them, then removed again; an existing file checked
    as open_file checks it, and left as it was. OutputRefused otherwise."""
    dirpath, name = os.path.split(os.path.abspath(path))
    made = []
    real = os.path.realpath(dirpath)
    probe = real
    while probe != "/" and not os.path.lexists(probe):
        made.append(probe)
        probe = os.path.dirname(probe)
    fd = None
    try:
        fd = open_dir(dirpath, True, uid, root)
        try:                                         # as the daemon would: made, then removed
            os.close(os.open(name, _NEW_FLAGS, mode, dir_fd=fd))
            os.unlink(name, dir_fd=fd)
            return
        except FileExistsError:                      # checked as it is, never opened
            try:
                st, mount = _look(fd, name)
            except OSError as e:
                raise OutputRefused(f"cannot open {path}: {e.strerror}", e.errno) from None
        except OSError as e:
            raise OutputRefused(f"cannot create {path}: {e.strerror}", e.errno) from None
        why = _refused(st, uid, mount, fd)
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
