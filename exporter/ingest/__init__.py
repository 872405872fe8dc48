"""nettap ingest: the capture's rotated JSON-lines files, forwarded to NATS
JetStream in acknowledged, de-duplicated batches (docs/ingest.md)."""
