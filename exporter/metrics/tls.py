"""The libssl files the TLS uprobes are on (exporter/kernel/tlsfiles.py):
how many, the bound, and the files refused, by reason."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.kernel import tls
from exporter.metrics.spec import families


class TlsFilesCollector(Collector):
    SPECS = [
        (GaugeMetricFamily, "nettap_tls_files", "libssl files the TLS uprobes are attached to.", []),
        (GaugeMetricFamily, "nettap_tls_files_limit",
         f"The most libssl files attached at once (of them, at most {tls.MAX_USER_FILES} brought by one user "
         "other than root).", []),
        (CounterMetricFamily, "nettap_tls_files_refused",
         "libssl files mapped by processes and not attached, by reason: limit, user_limit, fds (the bounds), "
         "not_regular, not_mapped (not provably the file mapped), fuse, timeout (no answer), no_symbols, error.",
         ["reason"]),
    ]

    def __init__(self, read: Callable[[], dict]):
        """read(): {"files": attached now, "refused": {reason: count}}."""
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        files, limit, refused = families(self.SPECS)
        c = self.read()
        files.add_metric([], c["files"])
        limit.add_metric([], tls.MAX_FILES)
        for reason in tls.REASONS:
            refused.add_metric([reason], c["refused"].get(reason, 0))
        return [files, limit, refused]
