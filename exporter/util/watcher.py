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

from .wakeup import Wakeup

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
        # A Wakeup, not a threading.Event: trigger() runs in a signal handler,
        # which Python may enter again between any two bytecodes of the
        # first; Event.set() takes a lock, so a burst of SIGHUPs nested the
        # handler until RecursionError (or could deadlock on that lock).
        # Wakeup.wake() takes none.
        self._wakeup = Wakeup()
        self._stop = False
        self._t = threading.Thread(target=self._run, name="nettap-config", daemon=True)

    def start(self) -> "ConfigWatcher":
        self._t.start()
        return self

    def trigger(self) -> None:
        """Reload now (safe from a signal handler, also nested in itself)."""
        self._last = _UNSEEN                    # differs even from a missing file's None
        self._wakeup.wake()

    def _run(self) -> None:
        while not self._stop:
            if select.select([self._wakeup], [], [], self.interval)[0]:
                self._wakeup.drain()            # every wake-up so far: one look at the file
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
        self._wakeup.wake()
        if self._t.is_alive():
            self._t.join()
        self._wakeup.close()                    # a signal after it wakes nothing
