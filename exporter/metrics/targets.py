"""Capture targets dropped because they went away (exporter.capture.filter)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily


class TargetsCollector:
    """``nettap_targets_gone_total{kind}``: pid and cgroup targets dropped
    because their process exited or their cgroup was removed."""

    def __init__(self, target_maps):
        """target_maps: an exporter.capture.filter.TargetMaps (its gone_total)."""
        self.tm = target_maps

    def _family(self):
        return CounterMetricFamily("nettap_targets_gone",
                                   "Capture targets dropped from the kernel's filter because their process exited "
                                   "(kind pid) or their cgroup was removed (kind cgroup).", labels=["kind"])

    def describe(self):
        return [self._family()]

    def collect(self):
        fam = self._family()
        for kind, n in sorted(self.tm.gone_total.items()):
            fam.add_metric([kind], n)
        return [fam]
