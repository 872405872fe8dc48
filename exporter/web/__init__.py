"""The endpoint: the HTTP server, the web config (TLS, basic auth), the landing
page. Imports exporter.util and exporter.config."""
