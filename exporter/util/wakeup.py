"""One wake-up for a thread that waits in select/poll/epoll on fds.

An eventfd (eventfd(2)): one fd that polls readable while its counter is
non-zero, where four self-pipes (two fds each) used to be. The config
watcher, the ring poller, the target watch and the HTTP parking thread each
hand :meth:`Wakeup.fileno` to their wait and call :meth:`Wakeup.wake` to end
it early.
"""

import os


class Wakeup:
    """Thread safety: :meth:`wake` may be called from any thread, and from a
    signal handler, also nested in itself: it is one non-blocking write(2)
    and takes no lock (a ``threading.Event`` does, which a signal arriving
    inside ``set()`` could deadlock on). It is a no-op once :meth:`close`
    has begun, so a late signal never writes to a reused fd. :meth:`drain`
    belongs to the one waiting thread; :meth:`close` runs once, after that
    thread has left its wait."""

    def __init__(self):
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False

    def fileno(self) -> int:
        """The fd to wait on: readable from a wake() until the next drain()."""
        return self._fd

    def wake(self) -> None:
        """End the waiter's wait (now, or its next one if it is not waiting)."""
        if self._closed:
            return
        try:
            os.eventfd_write(self._fd, 1)
        except OSError:                 # counter at its limit (2**64-2 wakes): awake anyway
            pass

    def drain(self) -> None:
        """Take every wake-up so far: the fd polls quiet until the next wake()."""
        try:
            os.eventfd_read(self._fd)   # reads and zeroes the whole counter
        except BlockingIOError:         # no wake-up pending
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True             # before the close: a handler may run in this thread
        os.close(self._fd)
