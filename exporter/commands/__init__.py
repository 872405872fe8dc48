"""The commands: flags and dispatch (cli), the daemon's wiring (daemon), and the
operator tools top, read (with pcap) and size. May import every layer."""
