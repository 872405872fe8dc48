"""Kubernetes: the kubelet's pod list as nettap takes it, and (with
metrics.kubernetes_labels) captured connections by namespace, pod and
container."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.metrics.spec import families

WORKLOAD = ["namespace", "pod", "container"]


class KubernetesCollector(Collector):
    """node: an exporter.capture.kube.Node (its kubelet's results, pods, the
    cgroups seen); workloads(): an exporter.capture.kubelines.Workloads or
    None, whose snapshot() is ({(namespace, pod, container): [connections,
    tx_bytes, rx_bytes, tx_calls, rx_calls, resets_sent, resets_received]},
    folded, forgotten); edit_failures(): batches of lines written unedited."""

    SPECS = [
        (CounterMetricFamily, "nettap_kubernetes_kubelet_polls",
         "Polls of the kubelet's pod list by result: ok, timeout, unreachable, http (an error status), too_large, "
         "malformed, token (its file unreadable), error (any other failure, logged); a failed poll keeps the last "
         "list.", ["result"]),
        (GaugeMetricFamily, "nettap_kubernetes_kubelet_last_success_timestamp_seconds",
         "When the kubelet's pod list was last taken.", []),
        (GaugeMetricFamily, "nettap_kubernetes_pods", "Pods in the kubelet's last list.", []),
        (GaugeMetricFamily, "nettap_kubernetes_pods_skipped",
         "Pods of the kubelet's last list left out: a namespace, name, label or container name the API server "
         "would not admit (logged).", []),
        (GaugeMetricFamily, "nettap_kubernetes_cgroups", "Cgroups of pods and their containers seen on this node.",
         []),
        (CounterMetricFamily, "nettap_kubernetes_line_edit_failures",
         "Batches of lines written without their pods because adding them failed (logged).", []),
    ]
    WORKLOAD_SPECS = [
        (CounterMetricFamily, "nettap_kubernetes_connections",
         "Captured connections (their owner lines) by the pod and container that owns them.", WORKLOAD),
        (CounterMetricFamily, "nettap_kubernetes_bytes",
         "Bytes of captured calls by pod and container and direction, counted at each connection's eof line.",
         WORKLOAD + ["direction"]),
        (CounterMetricFamily, "nettap_kubernetes_calls",
         "Captured calls that moved bytes, by pod and container and direction, counted at each connection's eof "
         "line.", WORKLOAD + ["direction"]),
        (CounterMetricFamily, "nettap_kubernetes_resets",
         "Resets captured connections sent and received (their reset lines), by pod and container.",
         WORKLOAD + ["direction"]),
        (CounterMetricFamily, "nettap_kubernetes_series_folded",
         "Records counted under pod=\"other\" because metrics.kubernetes_max_series containers had series.", []),
        (CounterMetricFamily, "nettap_kubernetes_connections_forgotten",
         "Connections whose owner's pod was forgotten before their eof line (more than 65,536 open at once).", []),
    ]

    def __init__(self, node, workloads: Callable[[], object], edit_failures: Callable[[], int]):
        self.node, self.workloads, self.edit_failures = node, workloads, edit_failures

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        polls, last, pods, skipped, cgroups, edits = out = families(self.SPECS)
        k = self.node.kubelet
        if k is not None:
            for result, n in k.results.items():
                polls.add_metric([result], n)
            if k.last_success:
                last.add_metric([], k.last_success)
            pods.add_metric([], len(k.pods))
            skipped.add_metric([], k.skipped)
        cgroups.add_metric([], len(self.node.cgroups))
        edits.add_metric([], self.edit_failures())
        w = self.workloads()
        if w is None:
            return out
        conns, nbytes, calls, resets, folded, forgotten = more = families(self.WORKLOAD_SPECS)
        w.forget_pods(self.node.pods_gone)           # pods gone since: their series too
        series, n_folded, n_forgotten = w.snapshot()
        for key, (c, tx_b, rx_b, tx_c, rx_c, rst_tx, rst_rx) in sorted(series.items()):
            labels = list(key)
            conns.add_metric(labels, c)
            for fam, tx, rx in ((nbytes, tx_b, rx_b), (calls, tx_c, rx_c), (resets, rst_tx, rst_rx)):
                fam.add_metric(labels + ["sent"], tx)
                fam.add_metric(labels + ["received"], rx)
        folded.add_metric([], n_folded)
        forgotten.add_metric([], n_forgotten)
        return out + more
