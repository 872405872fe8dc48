"""The kernel side: the libbpf binding, feature probes, loading and attaching the
programs, maps, fdinfo, BPF statistics, privileges and bpf/tcp.h's constants.
Imports exporter.util only."""
