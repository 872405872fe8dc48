"""What ingest did, as counters for the process's life, and their
Prometheus collector (the names are in docs/metrics.md#ingest)."""
from __future__ import annotations

from typing import Dict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LOST_REASONS = ("rotated", "too_large", "rejected")
PUBLISH_ERRORS = ("timeout", "no_responders", "disconnected", "rejected")
CONNECT_ERRORS = ("auth", "tls", "refused", "other")


class Stats:
    def __init__(self) -> None:
        self.records_published = 0
        self.bytes_published = 0
        self.records_acked = 0
        self.bytes_acked = 0
        self.acked_messages: Dict[str, int] = {"stored": 0, "duplicate": 0}
        self.publish_errors: Dict[str, int] = dict.fromkeys(PUBLISH_ERRORS, 0)
        self.lost: Dict[str, int] = dict.fromkeys(LOST_REASONS, 0)
        self.connect_errors: Dict[str, int] = dict.fromkeys(CONNECT_ERRORS, 0)
        self.connected = 0
        self.backlog_bytes = 0
        self.backlog_seconds = 0.0
        self.checkpoint_errors = 0


def _labelled(cls, name: str, doc: str, label: str, values: Dict[str, float]):
    m = cls(name, doc, labels=[label])
    for k, v in values.items():
        m.add_metric([k], v)
    return m


class StatsCollector:
    """Reads a Stats at scrape time (ints and floats: a torn read is not possible)."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self.stats
        C, G = CounterMetricFamily, GaugeMetricFamily
        yield C("nettap_ingest_records_published", "Lines sent to the engine (resends included).",
                value=s.records_published)
        yield C("nettap_ingest_bytes_published", "Bytes of the lines sent to the engine (resends included).",
                value=s.bytes_published)
        yield C("nettap_ingest_records_acked", "Lines the engine acknowledged as newly stored.", value=s.records_acked)
        yield C("nettap_ingest_bytes_acked", "Bytes of the lines the engine acknowledged as newly stored.",
                value=s.bytes_acked)
        yield _labelled(C, "nettap_ingest_messages_acked", "Acknowledgements by result: stored, or duplicate "
                        "(the engine had the message already: a resend after a crash or a lost ack).",
                        "result", s.acked_messages)
        yield _labelled(C, "nettap_ingest_publish_errors", "Failed publishes by reason; all but rejected are "
                        "sent again under the same message id.", "reason", s.publish_errors)
        yield _labelled(C, "nettap_ingest_records_lost", "Lines that will never reach the engine, by reason.",
                        "reason", s.lost)
        yield _labelled(C, "nettap_ingest_connect_errors", "Failed attempts to connect to the engine, by reason.",
                        "reason", s.connect_errors)
        yield C("nettap_ingest_checkpoint_write_errors", "Checkpoint writes that failed (nothing is sent until one "
                "succeeds).", value=s.checkpoint_errors)
        yield G("nettap_ingest_connected", "1 while connected to the engine.", value=s.connected)
        yield G("nettap_ingest_backlog_bytes", "Bytes of the capture files not yet acknowledged by the engine.",
                value=s.backlog_bytes)
        yield G("nettap_ingest_backlog_seconds", "Age of the oldest line not yet acknowledged (0 when caught up).",
                value=s.backlog_seconds)
