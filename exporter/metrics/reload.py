"""Config (re)loads: the last result, its time, counts by result."""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.metrics.spec import families


class ReloadCollector(Collector):
    """Config (re)loads: the last result, the time of the last success, counts."""

    SPECS = [
        (GaugeMetricFamily, "nettap_config_last_reload_successful", "1 if the last config load succeeded.", []),
        (GaugeMetricFamily, "nettap_config_last_reload_success_timestamp_seconds",
         "Time of the last successful config load.", []),
        (CounterMetricFamily, "nettap_config_reloads", "Config loads, by result.", ["result"]),
        (GaugeMetricFamily, "nettap_config_restart_pending",
         "1 while the config in force asks for a change that applies only at the next start.", []),
    ]

    def __init__(self, state):
        self.state = state

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        ok, ts, n, pending = families(self.SPECS)
        ok.add_metric([], 1 if self.state.last_ok else 0)
        ts.add_metric([], self.state.last_success)
        n.add_metric(["success"], self.state.successes)
        n.add_metric(["failure"], self.state.failures)
        pending.add_metric([], 1 if self.state.restart_pending else 0)
        return [ok, ts, n, pending]
