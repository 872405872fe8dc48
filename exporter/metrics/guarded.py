"""node_exporter's discipline for every collector: its own success and
duration series, and a failure that does not take the other collectors
down."""
from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, List

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class Guarded(Collector):
    """Runs named collectors, each guarded: a collector that raises loses
    its own series for this scrape and reports success 0; the rest go on."""

    def __init__(self, collectors: Dict[str, Collector]):
        self.collectors = collectors

    def describe(self) -> Iterable[Metric]:
        out: List[Metric] = []
        for c in self.collectors.values():
            out.extend(c.describe())
        return out + self._meta()[0:2]

    @staticmethod
    def _meta():
        return [GaugeMetricFamily("nettap_scrape_collector_success", "1 if the collector succeeded this scrape.",
                                  labels=["collector"]),
                GaugeMetricFamily("nettap_scrape_collector_duration_seconds",
                                  "How long the collector took this scrape.", labels=["collector"])]

    def collect(self) -> Iterable[Metric]:
        ok, dur = self._meta()
        out: List[Metric] = []
        for name, c in self.collectors.items():
            t = time.perf_counter()
            try:
                out.extend(list(c.collect()))
                success = 1
            except Exception as e:
                log.warning("collector %s failed: %s", name, e)
                success = 0
            ok.add_metric([name], success)
            dur.add_metric([name], time.perf_counter() - t)
        return out + [ok, dur]
