"""The capture path: record layouts and the compiled ring scan and JSON-lines
writer, the ring reader, the pipeline, sinks, decoding and the capture targets.
Imports exporter.util, exporter.kernel and exporter.config."""
