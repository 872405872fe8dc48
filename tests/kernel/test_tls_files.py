"""The libssl files nettap attaches the TLS uprobes to, against hostile
users (exporter/kernel/libfiles.py, tlsfiles.py): real processes as nobody,
real user and mount namespaces, real copies of the system's libssl mapped
by real processes."""
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import procs
from conftest import emulated
from exporter.kernel import libfiles, tls, uprobe_multi
from procs import free_port, wait_for

pytestmark = pytest.mark.skipif(not tls.supported()[0] or not tls.system_files() or not shutil.which("unshare"),
                                reason="no uprobes, no libssl.so or no unshare on this machine")

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# Map the libssl copies named, then (with a root given) chroot there: the
# kernel's maps lines then name the copies by paths nettap resolves
# differently, inside the process's root, where the user planted anything.
MAPPER = r"""
import ctypes, os, sys
root, paths = sys.argv[1], sys.argv[2:]
for p in paths:
    ctypes.CDLL(p)
if root != "-":
    os.chroot(root)
print("ready", flush=True)
sys.stdin.read()
"""
SSL = os.path.realpath(tls.system_files()[0]) if tls.system_files() else ""
WAIT = emulated(10, 120)            # s for what takes well under one here
# how nettap attaches here (tls.mechanism), unless NETTAP_TLS_UPROBE says otherwise
MECH = "uprobe_multi" if os.geteuid() == 0 and uprobe_multi.supported()[0] else "uprobe"


@pytest.fixture
def scratch():
    """A directory every user may traverse (pytest's tmp_path is root's 0700),
    a tmpfs of its own: in the qemu guests /tmp is an overlay, and before
    Linux 6.8 or so an overlay file's maps line and map_files name the inode
    of its layer, not the one stat gives the test (the product keys files by
    what the kernel maps, so it is the tests' keys that would differ); an
    overlay's upper layer cannot be an overlay either."""
    d = tempfile.mkdtemp(prefix="nettap-tlsf-", dir="/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=256m", "nettap-tlsf", d], check=True)
    procs_ = []
    try:
        yield d, procs_
    finally:
        for p in procs_:
            p.kill()
            p.wait()
        subprocess.run(["umount", "-R", "-l", d], check=False)
        shutil.rmtree(d, ignore_errors=True)


def copy(path, owner=None, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copy(SSL, path)
    os.chmod(path, mode)
    if owner is not None:
        for p in (path, os.path.dirname(path)):
            os.chown(p, owner, owner)
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def mapper(started, paths, root="-", user=(), userns=False):
    """A python mapping paths (then chrooted to root): started once it did."""
    cmd = [*user, *(["unshare", "-Ur"] if userns else []), "/usr/bin/python3", "-c", MAPPER, root, *paths]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout.readline().strip() == "ready"
    return p


def chroot_attacker(d, started, plant):
    """As nobody, in a user namespace: map R/lib/libssl.so.3 (its own copy),
    then chroot to R. Its maps line names /<d>/R/lib/libssl.so.3 (d_path from
    the reader's root), which /proc/PID/root resolves to R/<d>/R/lib/...:
    plant(that path) puts something there first. Returns (process, its copy's key)."""
    root = os.path.join(d, "R")
    key = copy(os.path.join(root, "lib", "libssl.so.3"), owner=65534)
    os.chown(root, 65534, 65534)
    planted = root + os.path.join(root, "lib", "libssl.so.3")
    os.makedirs(os.path.dirname(planted))
    plant(planted)
    for p in (planted, os.path.dirname(planted)):
        os.chown(p, 65534, 65534, follow_symlinks=False)
    return mapper(started, [os.path.join(root, "lib", "libssl.so.3")], root, NOBODY, userns=True), key


def secret_file(d):
    """A root-only copy of libssl (its directory 0700, the file 0600): its key."""
    os.mkdir(os.path.join(d, "secret"), 0o700)
    return copy(os.path.join(d, "secret", "libssl.so.3"), mode=0o600)


def test_the_mapped_file_is_opened_never_the_path_a_user_planted(scratch):
    """libfiles.open_mapped on real map lines of a chrooted nobody: through
    map_files, the file the process maps; through the path (nettap without
    CAP_SYS_ADMIN), a planted FIFO or symlink refused, and never waited on."""
    d, started = scratch
    os.mkdir(os.path.join(d, "a"))
    os.mkdir(os.path.join(d, "b"))
    fifo, fifo_key = chroot_attacker(os.path.join(d, "a"), started, os.mkfifo)
    secret = secret_file(d)
    link, link_key = chroot_attacker(os.path.join(d, "b"), started,
                                     lambda at: os.symlink(os.path.join(d, "secret", "libssl.so.3"), at))
    for p, key, reason in ((fifo, fifo_key, "not_regular"), (link, link_key, "not_mapped")):
        (line,) = libfiles.map_lines(libfiles.read_maps("/proc", p.pid), p.pid, tls.is_libssl)
        assert line.key == key
        t = time.monotonic()
        fd, st = libfiles.open_mapped(line)
        try:
            assert (st.st_dev, st.st_ino) == key != secret
        finally:
            os.close(fd)
        with pytest.raises(libfiles.Refused) as e:
            libfiles.open_mapped(line, map_files=False)
        assert e.value.reason == reason
        assert time.monotonic() - t < emulated(1, 10)


@pytest.mark.per_variant
def test_a_root_only_file_a_user_names_is_not_attached(nettap_run, mode, scratch):
    """A chrooted nobody whose maps line resolves, through /proc/PID/root, to
    a symlink to a root-only libssl: nettap attaches the file the process
    maps (its own copy), never the root-only one."""
    d, started = scratch
    secret = secret_file(d)
    _, key = chroot_attacker(d, started, lambda at: os.symlink(os.path.join(d, "secret", "libssl.so.3"), at))
    run = nettap_run({"captures": [{"port": free_port()}], "capture": {"tls": True}})
    files = run.app.probes.tls.files
    wait_for(lambda: key in files, timeout=WAIT, what="the process's own copy attached")
    assert secret not in files
    run.finish()


# One file, a copy of libssl, served by FUSE; while the stall file exists (up to
# 10 s), every request waits: a server that never answers, as any user can
# mount one in a user namespace.
FUSE_SERVER = r"""
import errno, os, stat, sys, time
from fusepy import FUSE, FuseOSError, Operations
src, mnt, stall = sys.argv[1:4]
data = open(src, "rb").read()
class One(Operations):
    def _wait(self):              # 10 s at most: a test killed meanwhile stalls no one for ever
        while os.path.exists(stall) and time.time() - os.stat(stall).st_mtime < 10:
            time.sleep(0.05)
    def getattr(self, path, fh=None):
        self._wait()
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/libssl.so.3":
            return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": len(data)}
        raise FuseOSError(errno.ENOENT)
    def readdir(self, path, fh):
        return [".", "..", "libssl.so.3"]
    def open(self, path, flags):
        self._wait()
        return 0
    def read(self, path, size, offset, fh):
        self._wait()
        return data[offset:offset + size]
print("serving", flush=True)
FUSE(One(), mnt, foreground=True, ro=True, attr_timeout=0, entry_timeout=0)    # every stat asks
"""
HAS_FUSE = os.path.exists("/dev/fuse") and subprocess.run(["/usr/bin/python3", "-c", "import fusepy"],
                                                          capture_output=True).returncode == 0


@contextlib.contextmanager
def stalling_fuse(d, started):
    """FUSE_SERVER mounted at d/mnt, serving a copy of libssl until d/stall
    exists: (the mount, the stall file); unstalled and unmounted after."""
    mnt, stall = os.path.join(d, "mnt"), os.path.join(d, "stall")
    os.mkdir(mnt)
    srv = subprocess.Popen(["/usr/bin/python3", "-c", FUSE_SERVER, SSL, mnt, stall], stdout=subprocess.PIPE,
                           text=True)
    started.append(srv)
    try:
        assert srv.stdout.readline().strip() == "serving"
        wait_for(lambda: os.path.ismount(mnt), timeout=WAIT, what="the FUSE mount")
        yield mnt, stall
    finally:
        if os.path.exists(stall):
            os.unlink(stall)
        subprocess.run(["umount", "-l", mnt], check=False)


@pytest.mark.skipif(not HAS_FUSE, reason="no /dev/fuse, or no python3-fusepy (scripts/setup.sh test installs it)")
@pytest.mark.per_variant
def test_a_libssl_on_fuse_is_refused_and_never_waited_on(nettap_run, mode, scratch):
    """A process maps a libssl served by FUSE, whose server then answers
    nothing: nettap refuses the file by its mount's type (read from the
    process's mountinfo, no request to the server), counts it, and a config
    apply returns at once (before: stat() waited on the server, under the
    config lock, for ever)."""
    d, started = scratch
    with stalling_fuse(d, started) as (mnt, stall):
        p = mapper(started, [os.path.join(mnt, "libssl.so.3")])
        (line,) = libfiles.map_lines(libfiles.read_maps("/proc", p.pid), p.pid, tls.is_libssl)
        doc = {"captures": [{"port": free_port()}]}
        run = nettap_run(doc)
        open(stall, "w").close()            # kept short: other nettaps on this machine may look too
        t = time.monotonic()
        run.apply({**doc, "capture": {"tls": True}})
        took = time.monotonic() - t
        os.unlink(stall)
        probes = run.app.probes
        assert took < emulated(3, 30), took
        assert probes.tls_counts()["refused"]["fuse"] >= 1
        assert line.key not in probes.tls.files
        run.finish()


@pytest.mark.skipif(not HAS_FUSE, reason="no /dev/fuse, or no python3-fusepy (scripts/setup.sh test installs it)")
def test_a_file_that_never_answers_is_skipped_after_the_deadline(nettap_run, scratch):
    """An overlay whose lower layer is that stalling FUSE server: the mount is
    an overlay, so the file is tried, and its fstat waits on the server.
    The scan gives up on it after tls.DEADLINE (counted: timeout), a new
    worker goes on, and a file mapped after it is attached."""
    d, started = scratch
    ov = os.path.join(d, "ov")
    for p in (ov, os.path.join(d, "up"), os.path.join(d, "work")):
        os.mkdir(p)
    with stalling_fuse(d, started) as (mnt, stall):
        try:
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={mnt},upperdir={d}/up,workdir={d}/work", ov], check=True)
            p = mapper(started, [os.path.join(ov, "libssl.so.3")])
            (line,) = libfiles.map_lines(libfiles.read_maps("/proc", p.pid), p.pid, tls.is_libssl)
            # Before Linux 6.8 or so a maps line names an overlay file by its layer's inode: FUSE's here
            on_fuse = libfiles.fs_type("/proc", p.pid, line.dev).startswith("fuse")
            doc = {"captures": [{"port": free_port()}]}
            run = nettap_run(doc)
            probes = run.app.probes
            open(stall, "w").close()
            t = time.monotonic()
            run.apply({**doc, "capture": {"tls": True}})
            took = time.monotonic() - t
            if on_fuse:
                assert took < emulated(3, 30) and probes.tls_counts()["refused"]["fuse"] == 1, took
            else:
                assert tls.DEADLINE <= took < tls.DEADLINE + emulated(2, 20), took
                # counted by the worker's watchdog, which may tick just after the apply gave up waiting
                wait_for(lambda: probes.tls_counts()["refused"]["timeout"] == 1, timeout=WAIT, what="timeout counted")
            late = copy(os.path.join(d, "late", "libssl.so.3"))
            mapper(started, [os.path.join(d, "late", "libssl.so.3")])
            wait_for(lambda: late in probes.tls.files, timeout=WAIT, what="a later file attached")
            os.unlink(stall)
            run.finish()
        finally:
            subprocess.run(["umount", "-l", ov], check=False)


def count(n, name, **labels):
    return n.sample(name, **labels) or 0


class Started(procs.Nettap):
    """procs.Nettap, killed if it never becomes ready."""

    def __init__(self, *a, **k):
        try:
            super().__init__(*a, **k)
        except BaseException:
            if hasattr(self, "p"):
                self.p.kill()
                self.p.wait()
            raise


def test_a_fifo_planted_before_start_stops_nothing(scratch, monkeypatch):
    """The FIFO planted before start (a chrooted nobody's maps line resolves
    to it): nettap becomes ready, attaches what the process maps, reloads
    apply, a later process's libssl is attached (dlopen ring drained), and
    SIGTERM ends it at once."""
    d, started = scratch
    _, key = chroot_attacker(d, started, os.mkfifo)
    monkeypatch.setattr(procs, "READY_TIMEOUT", emulated(30, 180))   # never, before: blocked in open() for ever
    port = free_port()
    cfg = {"captures": [{"port": port}], "capture": {"tls": True},
           "output": {"type": "jsonl", "root": d, "path": os.path.join(d, "out.jsonl")}}
    n = Started(tmp_path(d), cfg)
    try:
        system = len({os.stat(p).st_ino for p in tls.system_files() if not os.path.islink(p)})
        wait_for(lambda: count(n, "nettap_tls_files") == system + 1, timeout=WAIT, what="the copy attached")
        reload_applies(n, cfg)
        copy(os.path.join(d, "late", "libssl.so.3"))
        mapper(started, [os.path.join(d, "late", "libssl.so.3")])
        wait_for(lambda: count(n, "nettap_tls_files") == system + 2, timeout=WAIT, what="a later file attached")
    finally:
        rc, took = stop(n)
    assert rc == 0 and took < emulated(10, 100), took


def reload_applies(n, cfg) -> None:
    """A SIGHUP with a new port applies (the second successful reload)."""
    n.write_config({**cfg, "captures": [{"port": free_port()}]})
    os.kill(n.p.pid, signal.SIGHUP)
    wait_for(lambda: count(n, "nettap_config_reloads_total", result="success") == 2, timeout=WAIT,
             what="the reload applied")


def stop(n) -> tuple:
    """SIGTERM: (the exit status, s to the exit)."""
    t = time.monotonic()
    n.p.send_signal(signal.SIGTERM)
    rc = n.p.wait(emulated(60, 300))
    took = time.monotonic() - t
    n.log.close()
    return rc, took


def tmp_path(d):
    p = Path(d) / "nettap"
    p.mkdir(exist_ok=True)
    return p


@pytest.mark.per_variant
def test_one_users_files_are_bounded_and_released(nettap_run, mode, scratch):
    """nobody maps MAX_USER_FILES + 2 copies: MAX_USER_FILES attached, the rest
    refused and counted; a root process's copy mapped after is attached;
    once nobody's process exits, a rescan detaches its files (fds closed)."""
    d, started = scratch
    paths = [os.path.join(d, f"u{i}", "libssl.so.3") for i in range(tls.MAX_USER_FILES + 2)]
    keys = [copy(p, owner=65534) for p in paths]
    doc = {"captures": [{"port": free_port()}], "capture": {"tls": True}}
    hog = mapper(started, paths, user=NOBODY)
    run = nettap_run(doc)
    probes = run.app.probes
    files = probes.tls.files
    wait_for(lambda: sum(k in files for k in keys) == tls.MAX_USER_FILES, timeout=WAIT, what="nobody's files")
    # (no other test here reaches it; counted just after the fourth attach, which an emulated guest shows)
    wait_for(lambda: probes.tls_counts()["refused"]["user_limit"] >= 2, timeout=WAIT, what="user_limit counted")
    late = copy(os.path.join(d, "root", "libssl.so.3"))
    mapper(started, [os.path.join(d, "root", "libssl.so.3")])
    wait_for(lambda: late in files, timeout=WAIT, what="root's later copy attached")
    fds = len(os.listdir("/proc/self/fd"))
    hog.kill()
    hog.wait()
    run.apply(doc)                      # a rescan (as every reload): what no process maps is detached
    assert not any(k in files for k in keys) and late in files
    assert len(os.listdir("/proc/self/fd")) <= fds - tls.MAX_USER_FILES * tls.FDS_PER_FILE[probes.tls_mech] // 2
    run.finish()


def test_fds_are_kept_for_reloads(scratch):
    """A soft limit of 450 fds and 30 libssl copies mapped: nettap attaches
    while 256 fds stay free, counts the rest (fds), and reloads still apply
    (before: every attach took its fds until none was left, and a reload
    could not start its parser). 450 fds: before Linux 5.15 a uprobe is one
    fd (no perf link), so 600 left room for all 16 files there."""
    d, started = scratch
    paths = [os.path.join(d, f"c{i}", "libssl.so.3") for i in range(30)]
    for p in paths:
        copy(p)
    mapper(started, paths)
    cfg = {"captures": [{"port": free_port()}], "capture": {"tls": True},
           "output": {"type": "jsonl", "root": d, "path": os.path.join(d, "out.jsonl")}}
    # fewer than MAX_FILES files' fds past the reserve on every path: 24 a file
    # by perf links, 12 before 5.15 (no perf link), 9 by uprobe_multi links
    nofile = 450
    n = Started(tmp_path(d), cfg, wrap=["prlimit", f"--nofile={nofile}:{nofile}", "--"])
    try:
        wait_for(lambda: count(n, "nettap_tls_files_refused_total", reason="fds") > 0, timeout=WAIT,
                 what="refusals counted")
        assert count(n, "nettap_tls_files") > 0
        # (less the few a scrape's connection holds meanwhile)
        assert nofile - len(os.listdir(f"/proc/{n.p.pid}/fd")) >= tls.FD_RESERVE - 8
        reload_applies(n, cfg)
    finally:
        rc, took = stop(n)
    print(f"SIGTERM to exit: {took:.2f} s")
    assert rc == 0 and took < emulated(15, 150), took



def sigterm_to_exit(d, cfg, mech, env=None) -> tuple:
    """(s from SIGTERM to the exit of the CLI once it attached every copy
    mapped with mech, the files it had attached: the copies and the system's)."""
    n = Started(tmp_path(d), cfg, env=env)
    try:
        wait_for(lambda: count(n, "nettap_tls_files") >= EXIT_FILES + 1, timeout=WAIT, what="the files attached")
        files = count(n, "nettap_tls_files")
        assert count(n, "nettap_probe_attached", probe="ssl_read", mechanism=mech) == 1
        assert count(n, "nettap_kernel_feature_present", feature="uprobe_multi", since="6.6") == \
            (MECH == "uprobe_multi")
    finally:
        rc, took = stop(n)
    assert rc == 0
    return took, files


EXIT_FILES = 2
# s, any number of files, with uprobe_multi links: nettap's exit without TLS takes ~1.3 s here
EXIT_BOUND = emulated(2.5, 25)
PERF_BOUND = emulated(2, 20)            # s a file, with perf-event uprobes


def test_sigterm_exits_fast_with_files_attached(scratch):
    """EXIT_FILES libssl copies and the system's attached: where the kernel
    has uprobe_multi links (6.6+), SIGTERM to exit within 2.5 s (their
    detaches wait side by side; 1.4 s here, 1.3 s with TLS off), where
    perf-event uprobes (forced by NETTAP_TLS_UPROBE) take longer (4.5 s
    here: ~1 s a file, one uprobe at a time); before 6.6, perf-event
    uprobes alone, within their old bound (2 s a file)."""
    d, started = scratch
    paths = [os.path.join(d, f"x{i}", "libssl.so.3") for i in range(EXIT_FILES)]
    for p in paths:
        copy(p)
    mapper(started, paths)
    cfg = {"captures": [{"port": free_port()}], "capture": {"tls": True}, "output": {"type": "none"}}
    perf, files = sigterm_to_exit(d, cfg, "uprobe", env={**os.environ, tls.FORCE_ENV: "uprobe"})
    print(f"SIGTERM to exit, {files} files, perf-event uprobes: {perf:.2f} s")
    assert perf < PERF_BOUND * files
    if MECH == "uprobe_multi":
        multi, files = sigterm_to_exit(d, cfg, "uprobe_multi")
        print(f"SIGTERM to exit, {files} files, uprobe_multi links: {multi:.2f} s")
        assert multi < EXIT_BOUND and multi < perf, (multi, perf)
        if not emulated(False, True):       # a guest's bound is 10x: no room for the perf figure below it
            assert EXIT_BOUND < perf, (multi, perf)
