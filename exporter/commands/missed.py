"""What a set of capture files says was not captured, for ``nettap read``:
the gaps between the runs (their start and stop lines) and the windows of
the clock track that lost records."""
from __future__ import annotations

from typing import List, Tuple


def capture_gaps(marks: List[Tuple[str, str, int]]) -> List[str]:
    """What no nettap captured, from the runs' start and stop lines in file
    order: a stop, or a run that ended without one (killed, crashed, out of
    memory), up to the next start."""
    out, running, last = [], None, None        # running: the start of the run in progress
    for kind, when, pid in marks:
        if kind == "start":
            if running is not None:
                out.append(f"the run started {running[0]} (pid {running[1]}) has no stop line: it ended "
                           f"uncleanly; nothing was captured from its last record until {when}")
            elif last is not None:
                out.append(f"nothing was captured from the stop at {last} until the start at {when}")
            running, last = (when, pid), None
        else:
            running, last = None, when
    if running is not None and sum(kind == "start" for kind, _, _ in marks) > 1:
        out.append(f"the run started {running[0]} (pid {running[1]}) has no stop line yet (still running, "
                   "or it ended uncleanly)")
    return out


def clock_losses(clocks: List[Tuple[int, int, int]]) -> List[str]:
    """The windows of the clock track (pipeline.py) that lost records: each
    clock line counts what was dropped in the kernel and lost after the rings
    since the one before, so a reader can void that window."""
    from datetime import datetime, timezone

    def utc(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    out, prev = [], None
    for real, drops, lost in clocks:
        if drops or lost:
            since = f"from {utc(prev)}" if prev is not None else "from the start"
            out.append(f"{drops} dropped in the kernel and {lost} after the rings, {since} to {utc(real)}")
        prev = real
    return out
