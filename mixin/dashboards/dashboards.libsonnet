// nettap's Grafana dashboards, keyed by the file name they render to.
(import 'overview.libsonnet') +
(import 'bpf-programs.libsonnet') +
(import 'sizing.libsonnet')
