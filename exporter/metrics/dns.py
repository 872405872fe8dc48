"""Captured workloads' DNS: queries by rcode, latency, malformed, unmatched."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.metrics.spec import families


class DnsCollector(Collector):
    """Captured workloads' DNS (capture.dns), from exporter.capture.dns:
    ``read()`` returns its Counts. Every series exists from the start (each
    rcode once seen), so rates work before the first failure."""

    SPECS = [
        (CounterMetricFamily, "nettap_dns_queries",
         "DNS queries captured workloads sent, by the answer's response code (other: one not named), or "
         "timeout when none came within 5 s, or lost when the dns ring dropped records meanwhile.", ["rcode"]),
        (HistogramMetricFamily, "nettap_dns_latency_seconds",
         "Seconds from a captured DNS query to its answer (answered queries).", []),
        (CounterMetricFamily, "nettap_dns_malformed",
         "Messages to or from port 53 (UDP or TCP) of captured workloads that were not DNS or could not be read.", []),
        (CounterMetricFamily, "nettap_dns_responses_unmatched",
         "DNS answers captured workloads received for no query seen on that socket (sent before capture, "
         "or answered after the timeout).", []),
    ]
    RCODES = ("NOERROR", "NXDOMAIN", "SERVFAIL", "REFUSED", "timeout", "lost")

    def __init__(self, read: Callable[[], "object"], buckets: tuple):
        self.read, self.buckets = read, buckets

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        queries, latency, malformed, unmatched = families(self.SPECS)
        c = self.read()
        for rcode in sorted(set(self.RCODES) | set(c.queries)):
            queries.add_metric([rcode], c.queries.get(rcode, 0))
        les = [repr(float(b)) for b in self.buckets] + ["+Inf"]
        latency.add_metric([], list(zip(les, c.latency_buckets)), c.latency_sum)
        malformed.add_metric([], c.malformed)
        unmatched.add_metric([], c.unmatched)
        return [queries, latency, malformed, unmatched]
