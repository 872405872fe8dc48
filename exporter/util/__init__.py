"""Helpers with no nettap knowledge: log-safe text, safe file opening, a bounded
HTTP client, a config file watcher, the revision. Imports nothing else of nettap."""
