"""Capture targets dropped because they went away (exporter.capture.filter),
and what the kubernetes targets match (exporter.capture.kube)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class TargetsCollector:
    """``nettap_targets_gone_total{kind}``: pid and cgroup targets dropped
    because their process exited or their cgroup was removed;
    ``nettap_targets_kubernetes_cgroups{target}``: the cgroups each
    kubernetes target matches now; ``nettap_targets_kubernetes_update_failures_total``:
    changes of those the kernel's filter could not follow."""

    def __init__(self, target_maps, update_failures=lambda: 0):
        """target_maps: an exporter.capture.filter.TargetMaps (its gone_total,
        its current targets' matched); update_failures(): the count."""
        self.tm = target_maps
        self.update_failures = update_failures

    def _families(self):
        return [CounterMetricFamily("nettap_targets_gone",
                                    "Capture targets dropped from the kernel's filter because their process exited "
                                    "(kind pid) or their cgroup was removed (kind cgroup).", labels=["kind"]),
                GaugeMetricFamily("nettap_targets_kubernetes_cgroups",
                                  "Cgroups of this node's pods (or their containers) each kubernetes target matches "
                                  "now, in the kernel's filter.", labels=["target"]),
                CounterMetricFamily("nettap_targets_kubernetes_update_failures",
                                    "Changes of the kubernetes targets' cgroups (pods started or stopped) that the "
                                    "kernel's filter could not take (logged).")]

    def describe(self):
        return self._families()

    def collect(self):
        gone, matched, failures = self._families()
        for kind, n in sorted(self.tm.gone_total.items()):
            gone.add_metric([kind], n)
        for target, cids in sorted(self.tm.current.matched.items()):
            matched.add_metric([target], len(cids))
        failures.add_metric([], self.update_failures())
        return [gone, matched, failures]
