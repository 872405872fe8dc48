"""nettap: a lean eBPF TCP collector that tells exactly what running it costs."""
__version__ = "0.1.0"
