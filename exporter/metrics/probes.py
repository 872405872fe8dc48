"""The seed's probe counters and ring drops."""
from __future__ import annotations

from typing import Callable, Dict, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.metrics.spec import families


class ProbeCollector(Collector):
    """The seed's probe counters and ring drops, from per-CPU BPF maps.

    ``read_counters()`` returns {probe: {calls, returns, bytes, chunks}};
    ``read_drops()`` returns {ring: dropped}."""

    SPECS = [
        (CounterMetricFamily, "nettap_probe_calls", "Probe entry invocations acting on enabled captures.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_returns", "Probe return invocations acting on enabled captures.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_bytes_processed", "Bytes moved by the calls the probe captured.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_chunks_published",
         "Capture chunks published by the probe to the capture_chunks ring.", ["probe"]),
        (CounterMetricFamily, "nettap_ringbuf_drops", "Records dropped because a ring-buffer reserve failed.",
         ["ring"]),
    ]

    def __init__(self, read_counters: Callable[[], Dict[str, Dict[str, int]]],
                 read_drops: Callable[[], Dict[str, int]]):
        self.read_counters = read_counters
        self.read_drops = read_drops

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        calls, returns, nbytes, chunks, drops = families(self.SPECS)
        for probe, c in self.read_counters().items():
            calls.add_metric([probe], c["calls"])
            returns.add_metric([probe], c["returns"])
            nbytes.add_metric([probe], c["bytes"])
            chunks.add_metric([probe], c["chunks"])
        for ring, n in self.read_drops().items():
            drops.add_metric([ring], n)
        return [calls, returns, nbytes, chunks, drops]
