// The nettap monitoring mixin: prometheusAlerts, prometheusRules and grafanaDashboards, all
// driven by _config (config.libsonnet). Render with `python alerts/render.py`.
(import 'config.libsonnet') +
(import 'alerts.libsonnet') +
(import 'rules.libsonnet') +
(import '../dashboards/dashboards.libsonnet')
