"""Attach state, rings seen from user space, losses after the rings."""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.kernel import tcp_h
from exporter.metrics.spec import families


class PipelineCollector(Collector):
    """Attach state, rings seen from user space, losses after the rings."""

    SPECS = [
        (GaugeMetricFamily, "nettap_probe_attached",
         "1 when the probe is attached by that mechanism; mechanism none when it failed to attach, "
         "unsupported where the kernel lacks what it needs.",
         ["probe", "mechanism"]),
        (CounterMetricFamily, "nettap_ringbuf_records_drained", "Records read from the ring by user space.", ["ring"]),
        (CounterMetricFamily, "nettap_ringbuf_records_drained_by_kind",
         "Records read from the ring by user space, by record kind (a ring may carry several).", ["ring", "kind"]),
        (GaugeMetricFamily, "nettap_ringbuf_capacity_bytes", "Data size of the ring.", ["ring"]),
        (GaugeMetricFamily, "nettap_ringbuf_pending_bytes", "Bytes produced into the ring and not yet consumed.",
         ["ring"]),
        (CounterMetricFamily, "nettap_records_lost", "Records lost after the ring, by stage (queue, decode, sink).",
         ["stage"]),
        (CounterMetricFamily, "nettap_sink_records_written", "Records written by the sink.", ["sink"]),
        (CounterMetricFamily, "nettap_sink_errors", "Failed sink writes.", ["sink"]),
        (CounterMetricFamily, "nettap_sink_bytes_written", "Bytes written by the sink.", ["sink"]),
        (GaugeMetricFamily, "nettap_bpf_variant_info",
         "The BPF program variant loaded: fast (Linux 6.2+ features) or compat (5.8+).", ["variant"]),
        (GaugeMetricFamily, "nettap_kernel_feature_present",
         "1 when the kernel offers the BPF feature (since: the Linux release that brought it).",
         ["feature", "since"]),
    ]

    def __init__(self, app):
        self.app = app

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        attached, drained, by_kind, cap, pending, lost, written, errors, nbytes, variant, feats = \
            families(self.SPECS)
        probes = self.app.probes
        for probe, st in probes.all_states().items():
            attached.add_metric([probe, st.reported], 1 if st.attached else 0)
        variant.add_metric([probes.variant], 1)
        for f in probes.plan.features:
            feats.add_metric([f.name, f.since], 1 if f.present else 0)
        for name, ring in self.app.rings.items():
            drained.add_metric([name], ring.drained)
            for number, kind in tcp_h.NAMES["KIND"].items():
                if tcp_h.RECORDS[kind][0] == name:
                    by_kind.add_metric([name, kind], int(ring.kind_drained[number]))
            cap.add_metric([name], ring.size)
            pending.add_metric([name], ring.pending_bytes())
        pipe = self.app.pipeline
        sink = pipe.sink
        lost.add_metric(["queue"], pipe.lost["queue"])
        lost.add_metric(["decode"], pipe.lost["decode"])
        lost.add_metric(["sink"], sink.lost if sink else 0)
        if sink:
            written.add_metric([sink.name], sink.written)
            errors.add_metric([sink.name], sink.errors)
            nbytes.add_metric([sink.name], sink.bytes_written)
        return [attached, drained, by_kind, cap, pending, lost, written, errors, nbytes, variant, feats]
