"""Collectors for /metrics, one per module: build info, maps, the probes'
counters, the lifecycle and DNS counts, the pipeline, the programs'
statistics, the process's cgroup, reloads, targets gone, TLS files.
Imports exporter.util, exporter.kernel and exporter.config.

Each collector builds fresh metric families from what it reads now, has a
``describe()`` that reads nothing (so registering it does not touch the
kernel), and takes what it reads from through its constructor. The
:class:`guarded.Guarded` wrapper gives every collector node_exporter's
discipline: its own success and duration series, and a failure that does
not take the other collectors down."""
