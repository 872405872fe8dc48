"""The running collector: probes, capture targets, rings, pipeline and the
metrics registry, wired together, with one way to apply a config."""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

from prometheus_client import CollectorRegistry
from prometheus_client import gc_collector, platform_collector, process_collector

from . import targets
from .collectors import BuildInfoCollector, Guarded, PipelineCollector, ProbeCollector
from .config import Config, ConfigError
from .loader import Probes
from .maps import PerCpuArray
from .pipeline import Pipeline
from .records import PROBE_COUNTERS, PROBES, RINGS
from .ringbuf import RingMemory
from . import sinks

log = logging.getLogger(__name__)


class Nettap:
    """Load everything a Config asks for; :meth:`apply` later configs at run
    time; :meth:`close` releases everything (no kernel state stays)."""

    def __init__(self, config: Config, mechanism: Optional[str] = None):
        self.config = config
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self.probes = Probes(ring_sizes=config.ring_bytes, mechanism=mechanism)
        self.pipeline: Optional[Pipeline] = None
        self.rings: Dict[str, RingMemory] = {}
        try:
            fds = self.probes.map_fds
            self.target_maps = targets.TargetMaps(fds)
            self._counters = PerCpuArray(fds["probe_counters"], PROBE_COUNTERS)
            self._drops = PerCpuArray(fds["ringbuf_drops"], "<u8")
            keep = config.output.type != "none"        # no sink: count records, copy nothing
            self.rings = {r: RingMemory(r, fds[r], self.probes.map_info[r][3], copy=keep or r == "logs")
                          for r in RINGS}
            self.apply_targets(config)
            self.pipeline = Pipeline(self.rings, sinks.make(config.output), config.output.queue_records)
            self.pipeline.start()
            self.ready.set()
        except BaseException:
            self.close()
            raise

    # -- reading the kernel --
    def counters(self) -> Dict[str, Dict[str, int]]:
        return {p: self._counters.sum(i) for i, p in enumerate(PROBES)}

    def drops(self) -> Dict[str, int]:
        return {r: self._drops.sum(i)[""] for i, r in enumerate(RINGS)}

    def stats(self) -> dict:
        """The /stats document: the probe counters and drops as JSON."""
        return {"probes": {p: {"calls": c["calls"], "returns": c["returns"],
                               "bytes_processed": c["bytes"], "chunks_published": c["chunks"]}
                           for p, c in self.counters().items()},
                "ringbuf_drops": self.drops(),
                "ringbuf_records_drained": self.pipeline.drained if self.pipeline else {}}

    def not_ready(self) -> Optional[str]:
        """None when ready; else why not (for /readyz)."""
        if not self.ready.is_set() or not self.pipeline or not self.pipeline.running:
            return "starting"
        missing = [p for p, s in self.probes.states.items() if not s.attached]
        if len(missing) == len(self.probes.states):
            return "no probe attached: " + "; ".join(self.probes.states[p].error for p in missing)
        return None

    # -- configuration --
    def apply_targets(self, config: Config) -> None:
        """Resolve and write the capture targets (raises ConfigError, and
        then changes nothing)."""
        resolved = targets.resolve(config.captures)
        wake = config.ring_bytes["capture_chunks"] // 4
        with self._lock:
            self.target_maps.apply(resolved, config.max_payload_bytes, wake)
            self.config = config

    def registry(self, with_process: bool = True) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=False)
        if with_process:
            process_collector.ProcessCollector(registry=reg)
            platform_collector.PlatformCollector(registry=reg)
            gc_collector.GCCollector(registry=reg)
        reg.register(Guarded({
            "probes": ProbeCollector(self.counters, self.drops),
            "pipeline": PipelineCollector(self),
            "build": BuildInfoCollector(),
        }))
        return reg

    def close(self) -> None:
        self.ready.clear()
        if self.pipeline:
            self.pipeline.stop()
            self.pipeline = None
        for r in self.rings.values():
            r.close()
        self.rings = {}
        self.probes.close()


__all__ = ["Nettap", "ConfigError"]
