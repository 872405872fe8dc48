"""Collectors for /metrics that are not the capture's own: build info, maps,
the pipeline's counters, the process's cgroup. Imports exporter.util,
exporter.kernel and exporter.config."""
