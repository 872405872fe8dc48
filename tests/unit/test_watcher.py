"""exporter.util.watcher.ConfigWatcher on temp files: every way a config file
changes (edit in place, rename over, Kubernetes' ConfigMap symlink swap),
trigger() (SIGHUP), a deleted file or a symlink loop, and stop()."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from exporter.util.watcher import ConfigWatcher

INTERVAL = 0.05
SETTLE = 8 * INTERVAL            # long enough for several polls


class Calls:
    def __init__(self, action=None):
        self.n = 0
        self.cond = threading.Condition()
        self.action = action
        self.threads = set()

    def __call__(self):
        self.threads.add(threading.current_thread().name)
        with self.cond:
            self.n += 1
            self.cond.notify_all()
        if self.action:
            self.action()

    def wait(self, n: int, timeout: float = 3.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.n >= n, timeout)


@pytest.fixture
def watch():
    started = []

    def _watch(path, on_change, interval=INTERVAL):
        w = ConfigWatcher(str(path), on_change, interval).start()
        started.append(w)
        return w

    yield _watch
    for w in started:
        if w._t.is_alive():
            w.stop()


@pytest.fixture
def cfg(tmp_path) -> Path:
    p = tmp_path / "nettap.yaml"
    p.write_text("captures:\n  - port: 80\n")
    return p


def test_no_change_no_call(cfg, watch):
    calls = Calls()
    watch(cfg, calls)
    time.sleep(SETTLE)
    assert calls.n == 0


def test_edit_in_place_calls_once(cfg, watch):
    calls = Calls()
    watch(cfg, calls)
    ino = cfg.stat().st_ino
    with open(cfg, "a") as f:          # same inode, new size and mtime
        f.write("  - port: 443\n")
    assert cfg.stat().st_ino == ino
    assert calls.wait(1)
    time.sleep(SETTLE)
    assert calls.n == 1
    assert calls.threads == {"nettap-config"}


def test_edit_in_place_same_size(cfg):
    """Same size, same inode: the mtime alone tells. (The change is made
    between the fingerprint and start(), so one poll sees all of it.)"""
    calls = Calls()
    w = ConfigWatcher(str(cfg), calls, INTERVAL)
    st = cfg.stat()
    with open(cfg, "r+") as f:
        f.write("C")
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert (cfg.stat().st_size, cfg.stat().st_ino) == (st.st_size, st.st_ino)
    w.start()
    try:
        assert calls.wait(1)
        time.sleep(SETTLE)
        assert calls.n == 1
    finally:
        w.stop()


def test_rename_over(cfg, watch, tmp_path):
    calls = Calls()
    watch(cfg, calls)
    new = tmp_path / ".nettap.yaml.tmp"
    new.write_text("captures:\n  - port: 80\n")        # same content and size
    st = cfg.stat()
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # even the same mtime: the inode tells
    os.replace(new, cfg)
    assert calls.wait(1)
    time.sleep(SETTLE)
    assert calls.n == 1


def _k8s_volume(root: Path, content: str) -> Path:
    """A ConfigMap volume as the kubelet writes it (atomic_writer.go)."""
    v1 = root / "..2026_11_30_10_00_00.1"
    v1.mkdir(parents=True)
    (v1 / "nettap.yaml").write_text(content)
    (root / "..data").symlink_to(v1.name)
    (root / "nettap.yaml").symlink_to("..data/nettap.yaml")
    return root / "nettap.yaml"


def _k8s_swap(root: Path, content: str, name="..2026_11_30_10_05_00.2") -> None:
    old = os.readlink(root / "..data")
    v2 = root / name
    v2.mkdir()
    (v2 / "nettap.yaml").write_text(content)
    tmp = root / "..data_tmp"
    tmp.symlink_to(name)
    os.replace(tmp, root / "..data")     # rename(2): the swap is atomic
    for f in (root / old).iterdir():
        f.unlink()
    (root / old).rmdir()


def test_kubernetes_symlink_swap(tmp_path, watch):
    path = _k8s_volume(tmp_path / "config", "captures:\n  - port: 80\n")
    calls = Calls()
    w = watch(path, calls)
    time.sleep(SETTLE)
    assert calls.n == 0
    _k8s_swap(tmp_path / "config", "captures:\n  - port: 81\n")   # same size
    assert calls.wait(1)
    time.sleep(SETTLE)
    assert calls.n == 1
    assert path.read_text().endswith("81\n") and w.path == str(path)


def test_kubernetes_two_swaps(tmp_path, watch):
    root = tmp_path / "config"
    path = _k8s_volume(root, "a: 1\n")
    calls = Calls()
    watch(path, calls)
    _k8s_swap(root, "a: 2\n", "..v2")
    assert calls.wait(1)
    _k8s_swap(root, "a: 3\n", "..v3")
    assert calls.wait(2)
    time.sleep(SETTLE)
    assert calls.n == 2


def test_trigger_without_change(cfg, watch):
    calls = Calls()
    w = watch(cfg, calls, interval=30)       # a long poll: trigger must wake the thread
    t0 = time.monotonic()
    w.trigger()
    assert calls.wait(1, timeout=2)
    assert time.monotonic() - t0 < 2
    time.sleep(SETTLE)
    assert calls.n == 1
    w.trigger()
    assert calls.wait(2, timeout=2)


def test_trigger_from_a_signal_handler(cfg, watch):
    import signal
    calls = Calls()
    w = watch(cfg, calls, interval=30)
    old = signal.signal(signal.SIGUSR1, lambda *_: w.trigger())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls.wait(1, timeout=2)
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_deleted_file_is_a_change(cfg, watch):
    """A deleted config must reach on_change (which fails to read it and
    sets last_reload_successful to 0), once, not every poll."""
    calls = Calls()
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(a)
    try:
        w = watch(cfg, calls)
        cfg.unlink()
        assert calls.wait(1)
        time.sleep(SETTLE)
        assert calls.n == 1 and w._t.is_alive() and errors == []
        w.trigger()                         # SIGHUP while it is gone: tried again
        assert calls.wait(2)
        time.sleep(SETTLE)
        assert calls.n == 2
        cfg.write_text("captures: []\n")    # back: that is a change
        assert calls.wait(3)
    finally:
        threading.excepthook = old_hook


def test_symlink_loop_is_a_change(cfg, watch, tmp_path):
    calls = Calls()
    watch(cfg, calls)
    cfg.unlink()
    cfg.symlink_to(cfg.name)                # ELOOP
    assert calls.wait(1)
    time.sleep(SETTLE)
    assert calls.n == 1


def test_on_change_exception_keeps_watching(cfg, watch, caplog):
    def boom():
        raise RuntimeError("bad config")
    calls = Calls(boom)
    w = watch(cfg, calls)
    cfg.write_text("x: 1\n")
    assert calls.wait(1)
    time.sleep(SETTLE)
    assert calls.n == 1 and w._t.is_alive()
    assert "applying" in caplog.text and "bad config" in caplog.text
    cfg.write_text("x: 22\n")
    assert calls.wait(2)


def test_stop_joins_promptly(cfg, watch):
    calls = Calls()
    w = watch(cfg, calls, interval=30)
    time.sleep(0.05)
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 1
    assert not w._t.is_alive()


def test_no_call_after_stop(cfg, watch):
    calls = Calls()
    w = watch(cfg, calls)
    w.stop()
    cfg.write_text("changed: true\n")
    w.trigger()
    time.sleep(SETTLE)
    assert calls.n == 0


def test_stop_waits_for_a_running_on_change(cfg, watch):
    inside, release = threading.Event(), threading.Event()
    finished = []

    def slow():
        inside.set()
        release.wait(5)
        finished.append(1)

    w = watch(cfg, Calls(slow))
    w.trigger()
    assert inside.wait(2)
    threading.Timer(0.2, release.set).start()
    w.stop()
    assert finished == [1] and not w._t.is_alive()


def test_wakeup_wakes_drains_and_ignores_wakes_after_close():
    """The one wake-up the watcher, the ring poller, the target watch and
    the HTTP parking thread share: readable from wake() to drain(), many
    wakes drained at once, and a wake() after close() touches no fd."""
    import select

    from exporter.util.wakeup import Wakeup
    w = Wakeup()
    assert select.select([w], [], [], 0)[0] == []
    for _ in range(1000):
        w.wake()
    assert select.select([w], [], [], 0)[0] == [w]
    w.drain()
    assert select.select([w], [], [], 0)[0] == []
    w.drain()                                   # nothing pending: no error, no block
    w.close()
    w.wake()                                    # after close: a no-op, not a write to a reused fd
    w.close()
