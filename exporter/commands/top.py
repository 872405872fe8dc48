"""``nettap top``: every BPF program on the node, live, with what each costs.

One row a program (``bpfstats.node_programs``: the walk of every program id,
names as ``bpftool prog show`` gives them), its owner from a /proc scan
(``fdinfo.scan_bpf_holders``, redone only when a program id appears that the
last scan did not see), and rates between two samples: runs/s, ns per run,
and % of one CPU (run time per wall second). Below it, when a nettap answers
at ``--url``, its rings (fill, drops/s) and probes (calls/s).

The kernel counts run time only while its BPF statistics are on. The view
holds a ``BPF_ENABLE_STATS`` fd (``bpfstats.StatsSwitch``) from its start to
its end, and releases it on every way out: ``q``, Ctrl-C, SIGTERM and SIGHUP
unwind through the same ``finally``; on SIGKILL the kernel closes the fd.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import os
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from exporter.kernel import bpfstats, fdinfo, libbpf
from exporter.util.logsafe import escape

DEFAULT_URL = "http://127.0.0.1:42424/metrics"

# (key, heading, right-aligned): the sort keys of --sort and of keys 1-7.
COLUMNS: Tuple[Tuple[str, str, bool], ...] = (
    ("id", "ID", True), ("name", "NAME", False), ("type", "TYPE", False),
    ("owner", "OWNER", False), ("runs", "RUNS/S", True), ("ns", "NS/RUN", True),
    ("cpu", "%CPU", True))
KEYS = [c[0] for c in COLUMNS]
# Numbers sort largest first, words A to Z, on first choice.
_DESCENDING = {"runs", "ns", "cpu"}


@dataclass
class Row:
    id: int
    name: str
    type: str
    owner: str                      # "pid/comm", or "-" (pinned, or attached without a link fd)
    runs: Optional[float]           # runs/s; None on the first sample or for a new program
    ns: Optional[float]             # ns per run; None when it did not run
    cpu: Optional[float]            # % of one CPU


Sample = Dict[int, Tuple[bytes, int, int, int]]     # id -> (name, type, run_cnt, run_time_ns)


def rows(prev: Optional[Sample], cur: Sample, dt: float, holders: Dict[int, fdinfo.Holder]) -> List[Row]:
    """Rows for the programs of cur, rated against prev taken dt seconds earlier."""
    out = []
    for pid_, (name, ptype, cnt, ns) in cur.items():
        h = holders.get(pid_)
        r = Row(pid_, name.decode(errors="replace"), fdinfo.prog_type_name(ptype),
                f"{h.pid}/{h.comm}" if h else "-", None, None, None)
        before = prev.get(pid_) if prev else None
        if before is not None and dt > 0:
            dcnt, dns = max(cnt - before[2], 0), max(ns - before[3], 0)
            r.runs = dcnt / dt
            r.cpu = dns / dt / 1e7                   # ns per s / 1e9 * 100
            r.ns = dns / dcnt if dcnt else None
        out.append(r)
    return out


def sort_rows(rs: List[Row], key: str, reverse: bool = False) -> List[Row]:
    """Sorted by column key (largest first for numbers), reversed on request;
    rows without a figure last either way, ties by id."""
    desc = (key in _DESCENDING) != reverse
    have = [r for r in rs if getattr(r, key) is not None]
    none = sorted((r for r in rs if getattr(r, key) is None), key=lambda r: r.id)
    have.sort(key=lambda r: r.id)
    have.sort(key=lambda r: getattr(r, key), reverse=desc)
    return have + none


# ---- a running nettap, read from its endpoint

@dataclass
class NettapView:
    url: str
    error: Optional[str] = None                              # why nothing could be read
    version: str = ""
    rings: List[Tuple[str, Optional[float], Optional[float]]] = None    # (ring, fill 0-1, drops/s)
    probes: List[Tuple[str, Optional[float]]] = None                    # (probe, calls/s)


Scrape = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Scrape:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out: Scrape = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _by(scrape: Scrape, name: str, label: str) -> Dict[str, float]:
    return {dict(lbls)[label]: v for (n, lbls), v in scrape.items() if n == name and label in dict(lbls)}


def nettap_view(url: str, prev: Optional[Scrape], cur: Optional[Scrape], dt: float,
                error: Optional[str] = None) -> NettapView:
    """What the view shows of a nettap: cur read now, prev dt seconds earlier."""
    if cur is None:
        return NettapView(url, error=error or "no answer")
    if not any(n == "nettap_build_info" for n, _ in cur):
        return NettapView(url, error="not a nettap (no nettap_build_info)")
    version = next(dict(l).get("version", "") for (n, l) in cur if n == "nettap_build_info")

    def rate(name: str, label: str) -> Dict[str, Optional[float]]:
        now = _by(cur, name, label)
        then = _by(prev, name, label) if prev else {}
        return {k: (max(v - then[k], 0) / dt if k in then and dt > 0 else None) for k, v in now.items()}
    drops = rate("nettap_ringbuf_drops_total", "ring")
    cap = _by(cur, "nettap_ringbuf_capacity_bytes", "ring")
    pending = _by(cur, "nettap_ringbuf_pending_bytes", "ring")
    rings = [(r, pending[r] / cap[r] if cap.get(r) and r in pending else None, drops.get(r))
             for r in sorted(set(drops) | set(cap))]
    probes = sorted(rate("nettap_probe_calls_total", "probe").items())
    return NettapView(url, version=version, rings=rings, probes=probes)


def fetch(url: str, timeout: float = 0.5) -> Tuple[Optional[Scrape], Optional[str]]:
    """(samples, None), or (None, why not) when nothing answers or it is not Prometheus text."""
    from exporter.util.httpget import FetchError, get, shown
    try:
        body = get(url, deadline=timeout, max_bytes=16 << 20)
    except FetchError as e:
        return None, f"no nettap at {url}: {e}"
    try:
        return parse_metrics(body.decode("utf-8", "replace")), None
    except (ValueError, TypeError, IndexError, RecursionError) as e:
        return None, f"{url} is not a Prometheus endpoint ({shown(str(e))})"


# ---- rendering

def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _cell(value: str):
    """A value from elsewhere (a label value, a process name) as rich Text:
    control characters escaped (a terminal would obey them) and never read
    as rich markup."""
    from rich.text import Text
    return Text(escape(value))


def render(rs: List[Row], nt: Optional[NettapView], key: str, reverse: bool, status: str, live: bool = True):
    """The view: a status line, the programs table, and nettap's rings and probes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    head = {k: h + (" ▲" if (k in _DESCENDING) == reverse else " ▼") if k == key else h
            for k, h, _ in COLUMNS}
    t = Table(box=None, pad_edge=False, header_style="bold reverse" if live else "bold")
    for i, (k, _, right) in enumerate(COLUMNS):
        t.add_column(f"{i + 1}:{head[k]}" if live else head[k], justify="right" if right else "left",
                     no_wrap=True, overflow="ellipsis", max_width=48 if k == "name" else None)
    for r in sort_rows(rs, key, reverse):
        t.add_row(str(r.id), _cell(r.name), _cell(r.type), _cell(r.owner), _fmt(r.runs, ",.0f"), _fmt(r.ns, ",.0f"),
                  _fmt(r.cpu, ".2f"))
    runs = sum(r.runs or 0 for r in rs)
    cpu = sum(r.cpu or 0 for r in rs)
    keys = "  keys: 1-7 or ←/→ sort, r reverse, q quit" if live else ""
    parts = [Text(f"{len(rs)} BPF programs  {runs:,.0f} runs/s  {cpu:.2f}% of one CPU  {status}{keys}")]
    parts += [t, Text("")]
    if nt is None:
        pass
    elif nt.error:
        parts.append(_cell(f"nettap: {nt.error}"))
    else:
        parts.append(_cell(f"nettap {nt.version} at {nt.url}"))
        rt = Table(box=None, pad_edge=False, header_style="bold")
        for h, right in (("RING", False), ("FILL %", True), ("DROPS/S", True)):
            rt.add_column(h, justify="right" if right else "left", no_wrap=True)
        for ring, fill, drops in nt.rings:
            rt.add_row(_cell(ring), _fmt(None if fill is None else fill * 100, ".1f"), _fmt(drops, ",.1f"))
        pt = Table(box=None, pad_edge=False, header_style="bold")
        for h, right in (("PROBE", False), ("CALLS/S", True)):
            pt.add_column(h, justify="right" if right else "left", no_wrap=True)
        for probe, calls in nt.probes:
            pt.add_row(_cell(probe), _fmt(calls, ",.1f"))
        parts += [rt, Text(""), pt]
    return Group(*parts)


# ---- the command

class Top:
    """Samples the node's programs (and a nettap's endpoint) and keeps the
    last two samples for rates."""

    def __init__(self, url: Optional[str], proc_root: str = "/proc"):
        self.url, self.proc_root = url, proc_root
        self._names: Dict[int, bytes] = {}
        self._holders: Dict[int, fdinfo.Holder] = {}
        self._seen: set = set()
        self.prev: Optional[Sample] = None
        self.prev_scrape: Optional[Scrape] = None
        self.t = 0.0
        self.rows: List[Row] = []
        self.nettap: Optional[NettapView] = None

    def sample(self) -> None:
        now = time.monotonic()
        cur = {p[0]: p[1:] for p in bpfstats.node_programs(self._names)}
        if not set(cur) <= self._seen:
            self._holders = fdinfo.scan_bpf_holders(self.proc_root)
            self._seen = set(cur)
        dt = now - self.t
        self.rows = rows(self.prev, cur, dt, self._holders)
        if self.url:
            scrape, err = fetch(self.url)
            self.nettap = nettap_view(self.url, self.prev_scrape, scrape, dt, err)
            self.prev_scrape = scrape
        self.prev, self.t = cur, now


def _args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nettap top",
                                description="Every BPF program on the node, live: runs/s, ns per run, % of one CPU; "
                                "and a running nettap's rings and probes. Holds the kernel's BPF statistics on "
                                "(a BPF_ENABLE_STATS fd) while it runs, and only then.")
    p.add_argument("--sort", choices=KEYS, default="cpu", help="column to sort by (default: cpu)")
    p.add_argument("--reverse", action="store_true", help="reverse the sort order")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="between samples (default 1)")
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"a nettap's metrics endpoint; '' for none (default {DEFAULT_URL})")
    p.add_argument("--once", action="store_true",
                   help="print one table (two samples --interval apart) and exit")
    a = p.parse_args(argv)
    if a.interval <= 0:
        p.error("--interval must be above 0")
    return a


def _can_walk() -> Optional[str]:
    cur = ctypes.c_uint32(0)
    err = libbpf.lib().bpf_prog_get_next_id(0, ctypes.byref(cur))
    if err < 0 and -err != errno.ENOENT:
        return (f"cannot list BPF programs: {os.strerror(-err)}"
                + (" (needs root, or CAP_SYS_ADMIN)" if -err == errno.EPERM else ""))
    return None


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame):
    raise _Stop(signum)


def _stats_status(switch: bpfstats.StatsSwitch) -> str:
    src = switch.source()
    return {"fd": "stats: on (held by this view)",
            "sysctl": f"stats: on ({switch.sysctl}=1 set by this view until it exits)",
            "external": "stats: on (by another process)"}.get(src, "stats: OFF (no run times)")


def main(argv: Sequence[str]) -> int:
    a = _args(argv)
    if not a.once and not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("nettap top: the live view needs a terminal; use --once for one table", file=sys.stderr)
        return 2
    try:
        why = _can_walk()
    except OSError as e:
        why = f"cannot use libbpf: {e}"
    if why:
        print(f"nettap top: {why}", file=sys.stderr)
        return 1
    probe = bpfstats.KernelStatsProbe()
    switch = bpfstats.StatsSwitch(kernel_on=probe.on)
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            switch.set(True)
        except OSError as e:
            print(f"nettap top: cannot switch BPF statistics on: {e}; showing programs without run times",
                  file=sys.stderr)
        top = Top(a.url or None)
        if a.once:
            return _once(top, a, switch)
        return _live(top, a, switch)
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        switch.close()
        for s, h in old.items():
            signal.signal(s, h)
        still = probe.on()
        probe.close()
        if still:
            print("nettap top: BPF statistics released by this view; still on by another process's doing",
                  file=sys.stderr)


def _once(top: Top, a, switch) -> int:
    from rich.console import Console
    top.sample()
    time.sleep(a.interval)
    top.sample()
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(render(top.rows, top.nettap, a.sort, a.reverse, _stats_status(switch), live=False))
    console.file.flush()
    return 0


_ARROWS = {b"\x1b[C": 1, b"\x1bOC": 1, b"\x1b[D": -1, b"\x1bOD": -1}


def _live(top: Top, a, switch) -> int:
    import termios
    import tty
    from rich.console import Console
    from rich.live import Live
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    key, reverse = a.sort, a.reverse
    # The terminal's own size, read at each redraw (a resize applies), not a
    # COLUMNS/LINES the environment may carry from another terminal.
    console = Console(_environ={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")})
    try:
        tty.setcbreak(fd)                       # keys one by one; Ctrl-C still signals
        top.sample()
        status = _stats_status(switch)
        with Live(render(top.rows, top.nettap, key, reverse, status), console=console, screen=True,
                  auto_refresh=False) as live:
            due = time.monotonic() + a.interval
            while True:
                r, _, _ = select.select([fd], [], [], max(due - time.monotonic(), 0))
                if r:
                    k = os.read(fd, 32)
                    if k in (b"q", b"Q"):
                        return 0
                    if k[:1].isdigit() and 1 <= int(k[:1]) <= len(KEYS):
                        new = KEYS[int(k[:1]) - 1]
                        reverse = not reverse if new == key else False
                        key = new
                    elif k in _ARROWS:
                        key, reverse = KEYS[(KEYS.index(key) + _ARROWS[k]) % len(KEYS)], False
                    elif k in (b"r", b"R"):
                        reverse = not reverse
                    else:
                        continue
                else:
                    top.sample()
                    status = _stats_status(switch)
                    due = time.monotonic() + a.interval
                live.update(render(top.rows, top.nettap, key, reverse, status), refresh=True)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
