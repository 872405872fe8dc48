// The nettap monitoring mixin: prometheusAlerts, prometheusRules and grafanaDashboards, all
// driven by _config (config.libsonnet). Every import stays inside this folder, so that
// jsonnet-bundler can vendor it alone (README.md here). Render with `python mixin/render.py`.
(import 'config.libsonnet') +
(import 'alerts/alerts.libsonnet') +
(import 'rules/rules.libsonnet') +
(import 'dashboards/dashboards.libsonnet')
