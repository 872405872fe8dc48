"""The exporter's own cgroup: CPU throttling, memory usage, limit and OOM counters.

Reads, for the process ``pid`` (default ``self``):

- ``<proc_root>/<pid>/cgroup`` for the cgroup paths (``0::/path`` for v2,
  ``N:cpu,cpuacct:/path`` and ``N:memory:/path`` for v1);
- ``<proc_root>/<pid>/mountinfo`` for where each hierarchy is mounted (fstype
  ``cgroup2``, or ``cgroup`` with the controller in the super options). Mount
  points under ``/sys/fs/cgroup`` are re-rooted at ``cgroup_root``. Without
  mountinfo the conventional places are tried: v2 at ``cgroup_root`` or at
  ``cgroup_root/unified`` (hybrid), v1 at ``cgroup_root/<controllers>``;
- cgroup v2 files: ``cpu.stat`` (nr_periods, nr_throttled, throttled_usec),
  ``memory.current``, ``memory.max``, ``memory.events`` (oom, oom_kill);
- cgroup v1 files: ``cpu.stat`` (nr_periods, nr_throttled, throttled_time in
  ns), ``memory.usage_in_bytes``, ``memory.limit_in_bytes``,
  ``memory.oom_control`` (oom_kill, kernel >= 4.13).

v2 is preferred per controller when the v2 cgroup has the controller's files
(``cpu.stat`` with ``nr_periods``; ``memory.current``); otherwise v1 is used.
On hybrid systems the unified hierarchy usually has no controllers at all.

Series are absent, not zero, when a controller or file is not available, and
so is the memory limit when it is unlimited. A read error is logged at debug
level and only drops the series it concerns; ``collect()`` never raises.

Besides the metrics of docs/metrics.md this exposes ``nettap_cgroup_info{version,
path}`` = 1: one series per cgroup the metrics were read from (``version`` "1"
or "2", ``path`` as in /proc/PID/cgroup); usually one. When no controller is
available it names the v2 cgroup, if the process has one.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple, Union

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.util.mounts import parse as parse_mountinfo

log = logging.getLogger(__name__)

_Family = Union[CounterMetricFamily, GaugeMetricFamily]

DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"

# v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE, i.e. LONG_MAX rounded
# down to the page size: 0x7FFFFFFFFFFFF000 with 4 KiB pages, ...FFFF0000 with
# 64 KiB pages (mm/page_counter.c). Anything from the 64 KiB value up is "unlimited".
V1_UNLIMITED_MIN = 0x7FFFFFFFFFFF0000

# (metric name, type, help); read_cgroup_stats() keys are these names.
METRICS: Tuple[Tuple[str, str, str], ...] = (
    ("nettap_cgroup_cpu_periods_total", "counter", "CFS periods of nettap's cgroup."),
    ("nettap_cgroup_cpu_throttled_periods_total", "counter",
     "CFS periods in which nettap's cgroup was throttled."),
    ("nettap_cgroup_cpu_throttled_seconds_total", "counter", "Time nettap's cgroup was throttled."),
    ("nettap_cgroup_memory_usage_bytes", "gauge", "Memory usage of nettap's cgroup."),
    ("nettap_cgroup_memory_limit_bytes", "gauge",
     "Memory limit of nettap's cgroup (absent when unlimited)."),
    ("nettap_cgroup_memory_oom_events_total", "counter",
     "Times nettap's cgroup hit its memory limit and the OOM killer was invoked (v2 only)."),
    ("nettap_cgroup_memory_oom_kills_total", "counter",
     "Processes OOM-killed in nettap's cgroup."),
)
INFO_NAME = "nettap_cgroup_info"
INFO_HELP = "The cgroup nettap's cgroup metrics are read from (version 1 or 2), value 1."


@dataclass(frozen=True)
class ControllerDir:
    """Where one controller's files of the process's cgroup are."""

    version: str  # "1" or "2"
    path: str  # cgroup path as written in /proc/PID/cgroup
    directory: str  # directory holding the controller files


@dataclass(frozen=True)
class CgroupLocation:
    cpu: Optional[ControllerDir]
    memory: Optional[ControllerDir]
    v2_path: Optional[str]  # the "0::" line's path, if any

    def info(self) -> List[Tuple[str, str]]:
        """(version, path) pairs for nettap_cgroup_info."""
        pairs = {(d.version, d.path) for d in (self.cpu, self.memory) if d is not None}
        if not pairs and self.v2_path is not None:
            pairs.add(("2", self.v2_path))
        return sorted(pairs)


@dataclass(frozen=True)
class _Mount:
    fstype: str  # "cgroup" or "cgroup2"
    root: str  # mountinfo field 4: the cgroup path that is the mount's root
    mountpoint: str  # already re-rooted at cgroup_root
    controllers: FrozenSet[str]  # v1 super options (cpu, cpuacct, memory, name=...)


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _keyed(text: str) -> Dict[str, str]:
    """Parses "key value" lines (cpu.stat, memory.events, memory.oom_control)."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def _rebase(mountpoint: str, cgroup_root: str) -> Optional[str]:
    if cgroup_root == DEFAULT_CGROUP_ROOT:
        return mountpoint
    if mountpoint == DEFAULT_CGROUP_ROOT or mountpoint.startswith(DEFAULT_CGROUP_ROOT + "/"):
        return cgroup_root + mountpoint[len(DEFAULT_CGROUP_ROOT):]
    return None  # a mount outside the conventional place cannot be mapped into cgroup_root


def _parse_mountinfo(text: str, cgroup_root: str) -> List[_Mount]:
    out = []
    for m in parse_mountinfo(text):
        if m.fstype not in ("cgroup", "cgroup2"):
            continue
        mountpoint = _rebase(m.mountpoint, cgroup_root)
        if mountpoint is not None:
            out.append(_Mount(m.fstype, m.root, mountpoint, frozenset(m.super_options.split(","))))
    return out


def _join(mount: _Mount, path: str) -> str:
    # Without a cgroup namespace a container's mount root is its own cgroup
    # (e.g. /docker/<id>); the path below the mount is what follows that root.
    root = mount.root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    rel = path.lstrip("/")
    return os.path.join(mount.mountpoint, rel) if rel else mount.mountpoint


def _pick(mounts: List[_Mount], cgroup_root: str) -> Optional[_Mount]:
    """The first mount, preferring those under cgroup_root (a hierarchy may be mounted twice)."""
    under = [m for m in mounts if (m.mountpoint + "/").startswith(cgroup_root.rstrip("/") + "/")]
    chosen = under or mounts
    return chosen[0] if chosen else None


def locate_cgroup(proc_root: str = "/proc", cgroup_root: str = DEFAULT_CGROUP_ROOT,
                  pid: str = "self") -> CgroupLocation:
    """Finds the cpu and memory controller directories of the process's cgroup.

    Raises OSError when ``<proc_root>/<pid>/cgroup`` cannot be read.
    """
    v2_path: Optional[str] = None
    v1: Dict[str, Tuple[str, str]] = {}  # controller -> (controller list, path)
    for line in _read(os.path.join(proc_root, str(pid), "cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        else:
            for ctl in parts[1].split(","):
                v1[ctl] = (parts[1], parts[2])

    mounts: Optional[List[_Mount]] = None
    try:
        # No cgroup mount listed at all (e.g. a fake tree): try the conventional places.
        mounts = _parse_mountinfo(
            _read(os.path.join(proc_root, str(pid), "mountinfo")), cgroup_root) or None
    except OSError as e:
        log.debug("no mountinfo, using conventional cgroup mount points: %s", e)

    v2: Optional[ControllerDir] = None
    if v2_path is not None:
        if mounts is not None:
            unified = _pick([m for m in mounts if m.fstype == "cgroup2"], cgroup_root)
            if unified is not None:
                v2 = ControllerDir("2", v2_path, _join(unified, v2_path))
        else:
            for base in (cgroup_root, os.path.join(cgroup_root, "unified")):
                if os.path.exists(os.path.join(base, "cgroup.controllers")):
                    v2 = ControllerDir("2", v2_path, os.path.join(base, v2_path.lstrip("/")))
                    break

    def v2_has(filename: str, key: Optional[str] = None) -> bool:
        if v2 is None:
            return False
        if key is None:
            return os.path.exists(os.path.join(v2.directory, filename))
        try:
            text = _read(os.path.join(v2.directory, filename))
        except OSError:
            return False
        return key in _keyed(text)

    def v1_dir(ctl: str) -> Optional[ControllerDir]:
        if ctl not in v1:
            return None
        ctls, path = v1[ctl]
        if mounts is not None:
            found = _pick([m for m in mounts if m.fstype == "cgroup" and ctl in m.controllers],
                          cgroup_root)
            return ControllerDir("1", path, _join(found, path)) if found is not None else None
        for name in dict.fromkeys((ctls, ctl, "cpu,cpuacct", "cpuacct,cpu")):
            if ctl in name.split(",") and os.path.isdir(os.path.join(cgroup_root, name)):
                return ControllerDir("1", path, os.path.join(cgroup_root, name, path.lstrip("/")))
        return None

    cpu = v2 if v2_has("cpu.stat", "nr_periods") else v1_dir("cpu")
    memory = v2 if v2_has("memory.current") else v1_dir("memory")
    return CgroupLocation(cpu, memory, v2_path)


def _stats_from(loc: CgroupLocation) -> Dict[str, float]:
    out: Dict[str, float] = {}

    def read(d: ControllerDir, filename: str) -> Optional[str]:
        """The file's content stripped, or None (logged) when it cannot be read."""
        try:
            return _read(os.path.join(d.directory, filename)).strip()
        except OSError as e:
            log.debug("cgroup v%s: cannot read %s: %s", d.version, filename, e)
            return None

    def put(name: str, value: Optional[str], divisor: int = 1) -> None:
        if value is None:
            return
        try:
            out[name] = int(value) / divisor  # true division: exact for whole seconds
        except ValueError:
            log.debug("cgroup: %s: unexpected value %r", name, value)

    cpu = loc.cpu
    if cpu is not None:
        stat = _keyed(read(cpu, "cpu.stat") or "")
        put("nettap_cgroup_cpu_periods_total", stat.get("nr_periods"))
        put("nettap_cgroup_cpu_throttled_periods_total", stat.get("nr_throttled"))
        if cpu.version == "2":
            put("nettap_cgroup_cpu_throttled_seconds_total", stat.get("throttled_usec"), 10**6)
        else:
            put("nettap_cgroup_cpu_throttled_seconds_total", stat.get("throttled_time"), 10**9)

    mem = loc.memory
    if mem is not None and mem.version == "2":
        put("nettap_cgroup_memory_usage_bytes", read(mem, "memory.current"))
        limit = read(mem, "memory.max")
        if limit != "max":
            put("nettap_cgroup_memory_limit_bytes", limit)
        events = _keyed(read(mem, "memory.events") or "")
        put("nettap_cgroup_memory_oom_events_total", events.get("oom"))
        put("nettap_cgroup_memory_oom_kills_total", events.get("oom_kill"))
    elif mem is not None:
        put("nettap_cgroup_memory_usage_bytes", read(mem, "memory.usage_in_bytes"))
        limit = read(mem, "memory.limit_in_bytes")
        if limit is not None and limit.isdigit() and int(limit) < V1_UNLIMITED_MIN:
            put("nettap_cgroup_memory_limit_bytes", limit)
        # v1 counts no OOM events (under_oom is a state); oom_kill exists since 4.13.
        put("nettap_cgroup_memory_oom_kills_total",
            _keyed(read(mem, "memory.oom_control") or "").get("oom_kill"))
    return out


def read_cgroup_stats(proc_root: str = "/proc", cgroup_root: str = DEFAULT_CGROUP_ROOT,
                      pid: str = "self", location: Optional[CgroupLocation] = None
                      ) -> Dict[str, float]:
    """Reads the cgroup metrics now: {metric name: value}, only those available.

    Throttled time is converted to seconds. Pass ``location`` to skip locating
    the cgroup again. Never raises OSError: what cannot be read is left out.
    """
    if location is None:
        try:
            location = locate_cgroup(proc_root, cgroup_root, pid)
        except OSError as e:
            log.debug("cgroup: cannot read the process's cgroup: %s", e)
            return {}
    return _stats_from(location)


class CgroupCollector:
    """prometheus_client collector for the exporter's own cgroup (see module doc)."""

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = DEFAULT_CGROUP_ROOT,
                 pid: str = "self") -> None:
        self.proc_root = proc_root
        self.cgroup_root = cgroup_root
        self.pid = pid
        self._loc: Optional[CgroupLocation] = None
        self._loc_at = 0.0

    # Where the cgroup is changes only when the process is moved: locate it
    # (mountinfo and /proc/PID/cgroup parsing) at most every LOCATE_EVERY s.
    LOCATE_EVERY = 30.0

    def _location(self) -> CgroupLocation:
        now = time.monotonic()
        if self._loc is None or now - self._loc_at > self.LOCATE_EVERY:
            self._loc = locate_cgroup(self.proc_root, self.cgroup_root, self.pid)
            self._loc_at = now
        return self._loc

    @staticmethod
    def _families() -> Dict[str, _Family]:
        fams: Dict[str, _Family] = {}
        for name, kind, doc in METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fams[name] = cls(name, doc)
        fams[INFO_NAME] = GaugeMetricFamily(INFO_NAME, INFO_HELP, labels=["version", "path"])
        return fams

    def describe(self) -> List[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        try:
            loc = self._location()
            try:
                stats = read_cgroup_stats(location=loc)
            except OSError:                 # moved since: locate again
                self._loc = None
                loc = self._location()
                stats = read_cgroup_stats(location=loc)
            for version, path in loc.info():
                fams[INFO_NAME].add_metric([version, path], 1)
            for name, value in stats.items():
                fams[name].add_metric([], value)
        except Exception as e:  # a scrape must not fail because of this collector
            log.debug("cgroup collector: %s", e, exc_info=not isinstance(e, OSError))
            return
        yield from (f for f in fams.values() if f.samples)
