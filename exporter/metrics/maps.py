"""Kernel memory, entries and capacity of nettap's BPF maps."""
from __future__ import annotations

from typing import Callable, Dict, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.metrics.spec import families


class MapCollector(Collector):
    """Kernel memory, entries and capacity of nettap's BPF maps.

    Memory is the map's ``memlock`` from /proc/self/fdinfo (what the kernel
    charges for it). Entries are reported where they are known without
    walking a map: arrays are full by construction, the target maps hold
    what nettap wrote, and capture_conns has a live counter in the kernel.
    Inserts the kernel refused are counted in the kernel for the maps that
    capture depends on (bpf/tcp.h NETTAP_MAP_*)."""

    SPECS = [
        (GaugeMetricFamily, "nettap_bpf_map_memory_bytes", "Kernel memory of each nettap BPF map (fdinfo memlock).",
         ["map"]),
        (GaugeMetricFamily, "nettap_bpf_map_entries",
         "Entries in use in each nettap BPF map, where known without a walk.", ["map"]),
        (GaugeMetricFamily, "nettap_bpf_map_max_entries", "Capacity of each nettap BPF map (for rings: bytes).",
         ["map"]),
        (CounterMetricFamily, "nettap_bpf_map_insert_failures",
         "Inserts the kernel refused (the map full, or no memory), in the maps whose entries capture depends on.",
         ["map"]),
    ]
    ARRAY_TYPES = (2, 6)           # BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY
    GROWING_TYPES = (1, 29)        # HASH (not preallocated), TASK_STORAGE: memory changes

    def __init__(self, map_fds: Callable[[], Dict[str, int]], map_info: Callable[[], Dict[str, tuple]],
                 known_entries: Callable[[], Dict[str, int]],
                 insert_failures: Callable[[], Dict[str, int]] = dict):
        self.map_fds = map_fds
        self.map_info = map_info
        self.known_entries = known_entries
        self.insert_failures = insert_failures
        self._static_mem: Dict[int, int] = {}     # fd -> memlock of maps whose size is fixed

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def _memlock(self, fd: int, mtype: int) -> int:
        if fd in self._static_mem:
            return self._static_mem[fd]
        from exporter.kernel.fdinfo import parse_fdinfo
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mem = int(parse_fdinfo(f.read()).get("memlock", 0))
        if mtype not in self.GROWING_TYPES:
            self._static_mem[fd] = mem
        return mem

    def collect(self) -> Iterable[Metric]:
        mem, entries, cap, failures = families(self.SPECS)
        known = self.known_entries()
        info = self.map_info()
        for name, fd in sorted(self.map_fds().items()):
            mtype, _, _, max_entries = info[name]
            mem.add_metric([name], self._memlock(fd, mtype))
            cap.add_metric([name], max_entries)
            if name in known:
                entries.add_metric([name], known[name])
            elif mtype in self.ARRAY_TYPES:
                entries.add_metric([name], max_entries)
        for name, n in sorted(self.insert_failures().items()):
            failures.add_metric([name], n)
        return [mem, entries, cap, failures]
