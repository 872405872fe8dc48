"""Who may have a bcrypt check, and when: the failed-check throttle of
``basic_auth_users`` (exporter/web/webconfig.py).

bcrypt is slow by design, so a flood of wrong passwords could pin a core.
Failed checks together may use FAILED_CPU_SHARE of a core (a token bucket of
thread CPU seconds, FAILED_CPU_BURST deep). Past it, an address that failed
a check within FAILED_FORGET is answered 429 without a check; an address
with no recent failure is checked whatever the bucket holds, so a scraper
whose credential was never verified gets through a flood from elsewhere (a
global throttle alone locked it out: every scrape 429). Checks run one at a
time (together at most one core, however many addresses flood), an address
has one check running or waiting at most, and a request finding one running
waits for its turn, briefly, addresses with no recent failure first: a
flood holds at most two workers here, and a scraper's first check waits for
the one running only. Addresses are IPv4 addresses and IPv6 /64s (a host
usually has a whole /64); a flood from the scraper's own address (the same
host, NAT or proxy; the same /64, which the pods of one node may share)
throttles the scraper's new credentials too.
"""
from __future__ import annotations

import heapq
import ipaddress
import itertools
import threading
import time
from typing import Callable, Optional

# CPU for failed checks: a token bucket of thread CPU seconds, refilled at
# FAILED_CPU_SHARE of a core, holding at most FAILED_CPU_BURST.
FAILED_CPU_SHARE = 0.25
FAILED_CPU_BURST = 1.0
# Who is throttled: addresses that failed a check within FAILED_FORGET
# seconds; CLIENTS of them are remembered (the oldest forgotten first).
FAILED_FORGET = 60.0
CLIENTS = 4096
# A request finding a check running waits for its turn up to CHECK_WAIT
# seconds; WAITING requests at most (each holds a worker), one of them from
# an address that failed recently.
CHECK_WAIT = 1.0
WAITING = 4


def address(client: Optional[str]):
    """Whom a failed check is charged to: an IPv4 address (IPv4-mapped
    IPv6 too), an IPv6 /64, None when unknown."""
    if client is None:
        return None
    try:
        ip = ipaddress.ip_address(client.split("%", 1)[0])
    except ValueError:
        return client
    if ip.version == 4:
        return ip
    return ip.ipv4_mapped or ipaddress.ip_network(f"{ip}/64", strict=False)


class Throttle:
    """Thread-safe."""

    def __init__(self):
        self._turns = _Turns()
        self._lock = threading.Lock()              # the bucket, _failed, _checking
        self._budget, self._budget_at = FAILED_CPU_BURST, time.monotonic()
        self._failed: dict = {}                    # address -> its last failed check, oldest first
        self._checking: set = set()                # addresses with a check running or waiting

    def run(self, client: Optional[str], check: Callable[[], bool],
            passed: Callable[[bool], bool] = bool) -> Optional[bool]:
        """check()'s result, run in its turn for client (the peer's
        address), or None (answer 429) when client may not have a check
        now: it failed one within FAILED_FORGET and failed checks have used
        their share, or it has a check running or waiting, or the wait for
        the running one is full or too long. passed(result): whether the
        check passed (a failure is charged to the share and to client)."""
        who = address(client)
        with self._lock:
            last = self._failed.get(who)
            trusted = last is None or time.monotonic() - last > FAILED_FORGET
            if who in self._checking or (not trusted and self._refill() <= 0):
                return None
            self._checking.add(who)
        try:
            if not self._turns.enter(trusted):
                return None
            try:
                with self._lock:
                    if not trusted and self._refill() <= 0:      # spent while this one waited
                        return None
                t0 = time.thread_time()
                ok = check()
                spent = time.thread_time() - t0
            finally:
                self._turns.leave()
        finally:
            with self._lock:
                self._checking.discard(who)
        if not passed(ok):
            with self._lock:
                self._refill()
                self._budget -= spent
                self._failed.pop(who, None)
                self._failed[who] = time.monotonic()
                if len(self._failed) > CLIENTS:
                    self._failed.pop(next(iter(self._failed)))
        return ok

    def _refill(self) -> float:
        now = time.monotonic()
        self._budget = min(FAILED_CPU_BURST, self._budget + (now - self._budget_at) * FAILED_CPU_SHARE)
        self._budget_at = now
        return self._budget


class _Turns:
    """One check at a time. A request finding one running waits for its
    turn, up to CHECK_WAIT; at most WAITING wait, one of them untrusted
    (from an address that failed recently); trusted ones go first."""

    def __init__(self):
        self._cv = threading.Condition()
        self._busy = False
        self._queue: list = []                  # a heap of (untrusted, arrival)
        self._seq = itertools.count()

    def enter(self, trusted: bool) -> bool:
        with self._cv:
            if not self._busy and not self._queue:
                self._busy = True
                return True
            if len(self._queue) >= WAITING or (not trusted and any(q[0] for q in self._queue)):
                return False
            me = (not trusted, next(self._seq))
            heapq.heappush(self._queue, me)
            end = time.monotonic() + CHECK_WAIT
            while self._busy or self._queue[0] != me:
                left = end - time.monotonic()
                if left <= 0:
                    self._queue.remove(me)
                    heapq.heapify(self._queue)
                    self._cv.notify_all()
                    return False
                self._cv.wait(left)
            heapq.heappop(self._queue)
            self._busy = True
            return True

    def leave(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()
