"""nettap_build_info: the version, revision and platform."""
from __future__ import annotations

import platform
from typing import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.kernel import libbpf


class BuildInfoCollector(Collector):
    def __init__(self, revision: Callable[[], str] = None):
        self._info = [__version__, platform.release(), libbpf.version(), platform.python_version()]
        self._revision = revision
        self._rev = None

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("nettap_build_info", "nettap build and platform; value 1.",
                                 labels=["version", "revision", "kernel_release", "libbpf_version", "python_version"])

    def collect(self) -> Iterable[Metric]:
        if self._rev is None:       # at the first scrape: from a checkout it runs git (~2 ms), off the start path
            from exporter.util.revision import revision
            self._rev = (self._revision or revision)()
        g = self._family()
        g.add_metric([self._info[0], self._rev, *self._info[1:]], 1)
        return [g]
