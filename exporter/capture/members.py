"""Which processes do the capture targets name? (user space's answer to
what the kernel's filter, bpf/filter.bpf.h, decides call by call)

:func:`processes` gives the tgids of the live user processes a
:class:`~exporter.capture.targets.Resolved` set names, per target kind as
the filter matches it:

- pid: the process itself (``task_matches_for`` looks up the tgid), while
  it is the same process (its start time, as resolve() recorded it);
- cgroup: every process in the cgroup or in any cgroup below it (the filter
  compares the task's ancestor at the target's level): the ``cgroup.procs``
  of the directory and of every directory below it (``cgroup.threads`` in a
  threaded cgroup, where threads of one process may sit apart);
- netns: the processes in that network namespace (``/proc/PID/ns/net``).
  The filter tests the socket's namespace; a process holding a socket made
  in another namespace (passed over a unix socket, or made before setns)
  is not found here;
- port: the processes holding a TCP socket whose local or remote port is a
  target (``sock_matches_for`` compares ``skc_num`` and ``skc_dport``), as
  they are seen now: a process that opens one later is not among them.

Kernel threads are left out (they make no user-space calls), and so is
whatever vanishes during the walk (ENOENT, ESRCH) or may not be read (EACCES).
Only /proc's own links (``ns/net``, ``fd/N``) are read, with readlink; the
cgroup tree is walked without following links.

Cost: bench/target_processes.py prints it, docs/benchmarks.md has its run
(#finding-the-targets-processes). On a node of 2,100 processes in 21 network
namespaces here, a pid target took 0.03 ms, a cgroup target over the whole
tree or a netns target of 2,000 processes 34-75 ms, a port target 0.3-0.8 s.
What is read:

- pid: /proc/PID/stat, twice (start time; kernel thread?);
- cgroup: per cgroup at or below the target, cgroup.type and cgroup.procs;
  per member, /proc/PID/stat;
- netns, port: every process's ns/net link;
- netns: per member, /proc/PID/stat;
- port: per network namespace, its tcp and tcp6 tables (most of the cost:
  the kernel walks the whole TCP hash for each, whatever the namespace
  holds), then the fd links of the processes in the namespaces where a
  target port is in use.
"""
from __future__ import annotations

import errno
import os

from exporter.capture.targets import Resolved, start_time, tgid

PF_KTHREAD = 0x00200000        # include/linux/sched.h


def processes(resolved: Resolved, proc: str = "/proc", cgroup_root: str | None = None,
              more_cgroups: dict | None = None) -> set[int]:
    """The tgids of the live user processes the targets in resolved name.
    cgroup_root: read each cgroup target's path below this directory (a
    fake tree's root; None: the paths as the config wrote them).
    more_cgroups: path -> id of cgroups matched otherwise (kubernetes targets)."""
    found = {p for p in resolved.pids if _same(proc, p, resolved.pid_starts.get(p))}
    for path, cid in {**resolved.cgroup_paths, **(more_cgroups or {})}.items():
        if cid in resolved.cgroups:
            found |= cgroup_processes(cgroup_root + path if cgroup_root else path, cid, proc)
    if resolved.netns or resolved.ports:
        nets = netns_of_all(proc)
        found |= {p for p, ns in nets.items() if ns in resolved.netns}
        if resolved.ports:
            found |= port_processes(resolved.ports, nets, proc)
    return {p for p in found if is_user_process(proc, p)}


def _same(proc: str, pid: int, start: int | None) -> bool:
    """pid is still the process that had it when resolved (its start time)."""
    return start is not None and start_time(proc, pid) == start


def is_user_process(proc: str, pid: int) -> bool:
    """pid is alive and not a kernel thread (PF_KTHREAD in the flags, field
    9 of /proc/PID/stat)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
        return not int(stat[stat.rindex(b")") + 2:].split()[6]) & PF_KTHREAD
    except (OSError, ValueError, IndexError):
        return False


def _read(path: str) -> bytes | None:
    """A file's bytes; None if it is gone or unreadable. O_NOFOLLOW: a link
    in a cgroup tree is not a cgroup's file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError:
        return None


def _ints(data: bytes | None) -> list:
    return [int(x) for x in data.split() if x.isdigit()] if data else []


def cgroup_processes(path: str, cid: int, proc: str = "/proc") -> set[int]:
    """The tgids in cgroup directory path and every cgroup below it, if
    path is still the cgroup cid (else it was removed: none)."""
    try:
        if os.stat(path).st_ino != cid:
            return set()
    except OSError:
        return set()
    out: set = set()
    stack = [path]
    while stack:
        d = stack.pop()
        if (_read(f"{d}/cgroup.type") or b"").strip() == b"threaded":
            # cgroup.procs refuses to be read here (EOPNOTSUPP): the
            # threads it holds, and their processes
            out.update(t for t in (tgid(proc, tid) for tid in _ints(_read(f"{d}/cgroup.threads"))) if t)
        else:
            out.update(_ints(_read(f"{d}/cgroup.procs")))
        try:
            with os.scandir(d) as it:
                stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:            # removed meanwhile
            pass
    out.discard(0)                 # a process outside this pid namespace
    return out


def _inode(link: str, kind: str) -> int | None:
    """N of a /proc link's text "kind:[N]" (ns/net: net:[N], fd: socket:[N])."""
    if link.startswith(kind + ":[") and link.endswith("]"):
        try:
            return int(link[len(kind) + 2:-1])
        except ValueError:
            return None
    return None


def netns_of(proc: str, pid: int) -> int | None:
    """The inode of pid's network namespace (its /proc/PID/ns/net link)."""
    try:
        return _inode(os.readlink(f"{proc}/{pid}/ns/net"), "net")
    except OSError:
        return None


def netns_of_all(proc: str = "/proc") -> dict:
    """pid -> network namespace inode, for every process listed in proc."""
    out = {}
    for name in os.listdir(proc):
        if name.isdigit():
            ns = netns_of(proc, int(name))
            if ns is not None:
                out[int(name)] = ns
    return out


def tcp_socket_inodes(proc: str, pid: int, ports) -> set[int] | None:
    """The inodes of the TCP sockets of pid's network namespace whose local
    or remote port is in ports (/proc/PID/net/tcp and tcp6: "sl local_address
    rem_address st ... inode", each address HEX_IP:HEX_PORT, ports in host
    order); None if pid is gone. Sockets without an inode (TIME_WAIT,
    SYN_RECV requests) belong to no process and are left out."""
    out = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/{pid}/net/{name}", "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError as e:
            # no tcp6 without IPv6; any file missing of a process gone
            if name == "tcp6" and e.errno == errno.ENOENT and os.path.exists(f"{proc}/{pid}/net/tcp"):
                continue
            return None
        for line in lines:
            f = line.split()
            try:
                if (int(f[1][f[1].rindex(b":") + 1:], 16) in ports
                        or int(f[2][f[2].rindex(b":") + 1:], 16) in ports) and f[9] != b"0":
                    out.add(int(f[9]))
            except (ValueError, IndexError):
                continue
    return out


def holds_socket(proc: str, pid: int, inodes) -> bool:
    """Whether one of pid's fds (/proc/PID/fd/N -> "socket:[INODE]") is a
    socket among inodes."""
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:                # gone, or not ours to read
        return False
    for fd in fds:
        try:
            link = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:            # that fd closed meanwhile (or the process is gone)
            continue
        if _inode(link, "socket") in inodes:
            return True
    return False


def port_processes(ports, nets: dict, proc: str = "/proc") -> set[int]:
    """The processes (of nets: pid -> netns inode) holding a TCP socket with
    a port in ports: each namespace's TCP tables read once (through any of
    its processes that is still there), then the fds of its processes, only
    where a socket with such a port is open."""
    by_ns: dict = {}
    for pid, ns in nets.items():
        by_ns.setdefault(ns, []).append(pid)
    out = set()
    for pids in by_ns.values():
        inodes = None
        for pid in pids:
            inodes = tcp_socket_inodes(proc, pid, ports)
            if inodes is not None:
                break
        if inodes:
            out.update(p for p in pids if holds_socket(proc, p, inodes))
    return out
