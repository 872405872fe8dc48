"""Watching the config file: a change applies within a second.

Polling ``stat()`` of the path every half second catches every way a file
changes: an edit in place (mtime, size), a rename over it (inode), and the
symlink swap with which Kubernetes updates a mounted ConfigMap
(``..data`` -> ``..2026_11_30...``: stat follows the links, so the inode
changes). inotify would need watches on every link of that chain.
"""
from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable, Iterable, Optional, Tuple

log = logging.getLogger(__name__)


def _fingerprints(paths) -> tuple:
    return tuple((p, _fingerprint(p)) for p in paths)


def _fingerprint(path: str) -> Optional[Tuple[int, int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


_UNSEEN = ("unseen",)


class ConfigWatcher:
    """Calls on_change() from its own thread when path changes (appears,
    disappears, becomes unreadable), or one of the files it names does
    (also(): the paths the config in force was read from, e.g. a web
    config's certificates), and when trigger() is called (SIGHUP). stop()
    ends the thread."""

    def __init__(self, path: str, on_change: Callable[[], None], interval: float = 0.5,
                 also: Callable[[], Iterable[str]] = tuple):
        self.path = path
        self.on_change = on_change
        self.interval = interval
        self.also = also
        self._last = self._look()
        # A pipe, not a threading.Event: trigger() runs in a signal handler,
        # which Python may enter again between any two bytecodes of the
        # first; Event.set() takes a lock, so a burst of SIGHUPs nested the
        # handler until RecursionError (or could deadlock on that lock).
        # os.write to a non-blocking pipe takes none.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = False
        self._closed = False
        self._t = threading.Thread(target=self._run, name="nettap-config", daemon=True)

    def start(self) -> "ConfigWatcher":
        self._t.start()
        return self

    def trigger(self) -> None:
        """Reload now (safe from a signal handler, also nested in itself)."""
        self._last = _UNSEEN                    # differs even from a missing file's None
        self._wake()

    def _wake(self) -> None:
        if self._closed:                        # a signal after stop(): the fds may be reused
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:                         # full (a burst of SIGHUPs): it is awake anyway
            pass

    def _run(self) -> None:
        while not self._stop:
            if select.select([self._wake_r], [], [], self.interval)[0]:
                os.read(self._wake_r, 4096)     # every wake-up so far: one look at the file
            if self._stop:
                return
            fp = self._look()
            if fp == self._last:
                continue
            self._last = fp
            # A file gone (or a symlink loop) is a change too: on_change
            # tries it, fails and says so (the previous config stays).
            try:
                self.on_change()
            except Exception:
                log.exception("applying %s failed", self.path)
            now = self._look()
            if [p for p, _ in now] != [p for p, _ in fp]:   # the config in force names other files now
                self._last = now

    def _look(self) -> tuple:
        return _fingerprints((self.path, *self.also()))

    def stop(self) -> None:
        self._stop = True
        self._wake()
        if self._t.is_alive():
            self._t.join()
        self._closed = True                     # before the close: handlers run in this thread
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
