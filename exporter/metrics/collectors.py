"""Prometheus collectors that read the kernel and the pipeline at scrape time.

Each collector builds fresh metric families from what it reads now, has a
``describe()`` that reads nothing (so registering it does not touch the
kernel), and takes what it reads from through its constructor. The
:class:`Guarded` wrapper gives every collector node_exporter's discipline:
its own success and duration series, and a failure that does not take the
other collectors down.
"""
from __future__ import annotations

import itertools
import logging
import platform
import time
from typing import Callable, Dict, Iterable, List

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.kernel import libbpf, tcp_h

log = logging.getLogger(__name__)


def _families(specs) -> List[Metric]:
    return [kind(name, doc, labels=labels) for kind, name, doc, labels in specs]


class ProbeCollector(Collector):
    """The seed's probe counters and ring drops, from per-CPU BPF maps.

    ``read_counters()`` returns {probe: {calls, returns, bytes, chunks}};
    ``read_drops()`` returns {ring: dropped}."""

    SPECS = [
        (CounterMetricFamily, "nettap_probe_calls", "Probe entry invocations acting on enabled captures.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_returns", "Probe return invocations acting on enabled captures.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_bytes_processed", "Bytes moved by the calls the probe captured.",
         ["probe"]),
        (CounterMetricFamily, "nettap_probe_chunks_published",
         "Capture chunks published by the probe to the capture_chunks ring.", ["probe"]),
        (CounterMetricFamily, "nettap_ringbuf_drops", "Records dropped because a ring-buffer reserve failed.",
         ["ring"]),
    ]

    def __init__(self, read_counters: Callable[[], Dict[str, Dict[str, int]]],
                 read_drops: Callable[[], Dict[str, int]]):
        self.read_counters = read_counters
        self.read_drops = read_drops

    def describe(self) -> Iterable[Metric]:
        return _families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        calls, returns, nbytes, chunks, drops = _families(self.SPECS)
        for probe, c in self.read_counters().items():
            calls.add_metric([probe], c["calls"])
            returns.add_metric([probe], c["returns"])
            nbytes.add_metric([probe], c["bytes"])
            chunks.add_metric([probe], c["chunks"])
        for ring, n in self.read_drops().items():
            drops.add_metric([ring], n)
        return [calls, returns, nbytes, chunks, drops]


def _nonzero(rows) -> list:
    """The indexes of the non-zero rows."""
    return [i for i, v in enumerate(rows) if v]


class LifecycleCollector(Collector):
    """What captured sockets did, counted in the kernel (the obs_counters
    rows, bpf/tcp.h NETTAP_OBS_*) whether or not their records found room on
    obs_events. ``read()`` returns the rows summed over CPUs (a sequence of ints).

    Bounded label sets: a state change only for the pairs seen (the kernel's
    states, at most 12 x 12), an error only for the numbers seen (their names;
    255 and above as "other"), both reset directions, every retransmission
    cause, both timers and both probes always."""

    SPECS = [
        (CounterMetricFamily, "nettap_tcp_state_changes", "TCP state changes of captured sockets.", ["from", "to"]),
        (CounterMetricFamily, "nettap_tcp_resets",
         "Resets sent and received by captured sockets.", ["direction"]),
        (CounterMetricFamily, "nettap_tcp_socket_errors",
         "Errors captured sockets reported (sock:inet_sk_error_report, Linux 5.14+), by name.", ["errno"]),
        (CounterMetricFamily, "nettap_tcp_retransmits",
         "Segments captured sockets sent again, by the recovery that sent them (rto: the retransmission "
         "timer; tlp: a tail loss probe; fast: recovery on ACKs), and SYN-ACKs sent again to captured "
         "ports (synack).", ["kind"]),
        (HistogramMetricFamily, "nettap_tcp_timer_behind_jiffies",
         "Jiffies from a captured socket's timer's slot on the wheel to when its CPU fired it "
         "(a stalled CPU, a vCPU the host stopped), by timer.", ["timer"]),
        (CounterMetricFamily, "nettap_tcp_probes",
         "Probes captured sockets' timers sent: zero-window probes (window) and keepalive probes (keepalive).",
         ["probe"]),
    ]
    # bpf/timer.bpf.h's buckets of behind_jiffies: 0, then below 2^b for b of 1..8
    BEHIND_LE = ("0", "1", "3", "7", "15", "31", "63", "127", "255", "+Inf")

    def __init__(self, read: Callable[[], "object"], state_names: tuple, errno_names: dict):
        """state_names: the kernel's TCP state names by number; errno_names:
        error names by number (exporter.capture.records, the JSON forms')."""
        self.read, self.state_names, self.errno_names = read, state_names, errno_names

    def describe(self) -> Iterable[Metric]:
        return _families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        states, resets, errors, retrans, behind, probes = _families(self.SPECS)
        rows = self.read()
        # bpf/tcp.h's blocks of rows and names of values (NETTAP_OBS_*, NETTAP_RETRANS_*, ...), generated
        block = {name: rows[first:end] for name, (first, end) in tcp_h.OBS_BLOCKS.items()}
        for i in _nonzero(block["states"]):
            old, new = divmod(i, 16)
            states.add_metric([self._state(old), self._state(new)], int(block["states"][i]))
        for d, name in ((tcp_h.DIR_EGRESS, "sent"), (tcp_h.DIR_INGRESS, "received")):
            resets.add_metric([name], int(block["resets"][d]))
        for e in _nonzero(block["errors"]):
            name = "other" if e >= 255 else self.errno_names.get(e, str(e))
            errors.add_metric([name], int(block["errors"][e]))
        for cause, name in tcp_h.NAMES["RETRANS"].items():
            retrans.add_metric([name], int(block["retrans"][cause]))
        for timer, name in tcp_h.NAMES["TIMER"].items():
            own = block["timers"][timer * 16:timer * 16 + 16]       # timer.bpf.h: 10 buckets, row 15 the sum
            counts = list(itertools.accumulate(int(n) for n in own[:10]))
            behind.add_metric([name], list(zip(self.BEHIND_LE, counts)), int(own[15]))
        for probe, name in tcp_h.NAMES["WAKEUP"].items():
            probes.add_metric([name], int(block["wakeups"][probe]))
        return [states, resets, errors, retrans, behind, probes]

    def _state(self, n: int) -> str:
        return self.state_names[n] if 0 < n < len(self.state_names) else str(n)


class DnsCollector(Collector):
    """Captured workloads' DNS (capture.dns), from exporter.capture.dns:
    ``read()`` returns its Counts. Every series exists from the start (each
    rcode once seen), so rates work before the first failure."""

    SPECS = [
        (CounterMetricFamily, "nettap_dns_queries",
         "DNS queries captured workloads sent, by the answer's response code (other: one not named), or "
         "timeout when none came within 5 s, or lost when the dns ring dropped records meanwhile.", ["rcode"]),
        (HistogramMetricFamily, "nettap_dns_latency_seconds",
         "Seconds from a captured DNS query to its answer (answered queries).", []),
        (CounterMetricFamily, "nettap_dns_malformed",
         "Messages to or from UDP port 53 of captured workloads that were not DNS or could not be read.", []),
        (CounterMetricFamily, "nettap_dns_responses_unmatched",
         "DNS answers captured workloads received for no query seen on that socket (sent before capture, "
         "or answered after the timeout).", []),
    ]
    RCODES = ("NOERROR", "NXDOMAIN", "SERVFAIL", "REFUSED", "timeout", "lost")

    def __init__(self, read: Callable[[], "object"], buckets: tuple):
        self.read, self.buckets = read, buckets

    def describe(self) -> Iterable[Metric]:
        return _families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        queries, latency, malformed, unmatched = _families(self.SPECS)
        c = self.read()
        for rcode in sorted(set(self.RCODES) | set(c.queries)):
            queries.add_metric([rcode], c.queries.get(rcode, 0))
        les = [repr(float(b)) for b in self.buckets] + ["+Inf"]
        latency.add_metric([], list(zip(les, c.latency_buckets)), c.latency_sum)
        malformed.add_metric([], c.malformed)
        unmatched.add_metric([], c.unmatched)
        return [queries, latency, malformed, unmatched]


class PipelineCollector(Collector):
    """Attach state, rings seen from user space, losses after the rings."""

    SPECS = [
        (GaugeMetricFamily, "nettap_probe_attached",
         "1 when the probe is attached by that mechanism; mechanism none when it failed to attach, "
         "unsupported where the kernel lacks what it needs.",
         ["probe", "mechanism"]),
        (CounterMetricFamily, "nettap_ringbuf_records_drained", "Records read from the ring by user space.", ["ring"]),
        (CounterMetricFamily, "nettap_ringbuf_records_drained_by_kind",
         "Records read from the ring by user space, by record kind (a ring may carry several).", ["ring", "kind"]),
        (GaugeMetricFamily, "nettap_ringbuf_capacity_bytes", "Data size of the ring.", ["ring"]),
        (GaugeMetricFamily, "nettap_ringbuf_pending_bytes", "Bytes produced into the ring and not yet consumed.",
         ["ring"]),
        (CounterMetricFamily, "nettap_records_lost", "Records lost after the ring, by stage (queue, decode, sink).",
         ["stage"]),
        (CounterMetricFamily, "nettap_sink_records_written", "Records written by the sink.", ["sink"]),
        (CounterMetricFamily, "nettap_sink_errors", "Failed sink writes.", ["sink"]),
        (CounterMetricFamily, "nettap_sink_bytes_written", "Bytes written by the sink.", ["sink"]),
        (GaugeMetricFamily, "nettap_bpf_variant_info",
         "The BPF program variant loaded: fast (Linux 6.2+ features) or compat (5.8+).", ["variant"]),
        (GaugeMetricFamily, "nettap_kernel_feature_present",
         "1 when the kernel offers the BPF feature (since: the Linux release that brought it).",
         ["feature", "since"]),
    ]

    def __init__(self, app):
        self.app = app

    def describe(self) -> Iterable[Metric]:
        return _families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        attached, drained, by_kind, cap, pending, lost, written, errors, nbytes, variant, feats = \
            _families(self.SPECS)
        probes = self.app.probes
        for probe, st in probes.all_states().items():
            attached.add_metric([probe, st.reported], 1 if st.attached else 0)
        variant.add_metric([probes.variant], 1)
        for f in probes.plan.features:
            feats.add_metric([f.name, f.since], 1 if f.present else 0)
        for name, ring in self.app.rings.items():
            drained.add_metric([name], ring.drained)
            for number, kind in tcp_h.NAMES["KIND"].items():
                if tcp_h.RECORDS[kind][0] == name:
                    by_kind.add_metric([name, kind], int(ring.kind_drained[number]))
            cap.add_metric([name], ring.size)
            pending.add_metric([name], ring.pending_bytes())
        pipe = self.app.pipeline
        sink = pipe.sink
        lost.add_metric(["queue"], pipe.lost["queue"])
        lost.add_metric(["decode"], pipe.lost["decode"])
        lost.add_metric(["sink"], sink.lost if sink else 0)
        if sink:
            written.add_metric([sink.name], sink.written)
            errors.add_metric([sink.name], sink.errors)
            nbytes.add_metric([sink.name], sink.bytes_written)
        return [attached, drained, by_kind, cap, pending, lost, written, errors, nbytes, variant, feats]


class BuildInfoCollector(Collector):
    def __init__(self, revision: Callable[[], str] = None):
        self._info = [__version__, platform.release(), libbpf.version(), platform.python_version()]
        self._revision = revision
        self._rev = None

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("nettap_build_info", "nettap build and platform; value 1.",
                                 labels=["version", "revision", "kernel_release", "libbpf_version", "python_version"])

    def collect(self) -> Iterable[Metric]:
        if self._rev is None:       # at the first scrape: from a checkout it runs git (~2 ms), off the start path
            from exporter.util.revision import revision
            self._rev = (self._revision or revision)()
        g = self._family()
        g.add_metric([self._info[0], self._rev, *self._info[1:]], 1)
        return [g]


class Guarded(Collector):
    """Runs named collectors, each guarded: a collector that raises loses
    its own series for this scrape and reports success 0; the rest go on."""

    def __init__(self, collectors: Dict[str, Collector]):
        self.collectors = collectors

    def describe(self) -> Iterable[Metric]:
        out: List[Metric] = []
        for c in self.collectors.values():
            out.extend(c.describe())
        return out + self._meta()[0:2]

    @staticmethod
    def _meta():
        return [GaugeMetricFamily("nettap_scrape_collector_success", "1 if the collector succeeded this scrape.",
                                  labels=["collector"]),
                GaugeMetricFamily("nettap_scrape_collector_duration_seconds",
                                  "How long the collector took this scrape.", labels=["collector"])]

    def collect(self) -> Iterable[Metric]:
        ok, dur = self._meta()
        out: List[Metric] = []
        for name, c in self.collectors.items():
            t = time.perf_counter()
            try:
                out.extend(list(c.collect()))
                success = 1
            except Exception as e:
                log.warning("collector %s failed: %s", name, e)
                success = 0
            ok.add_metric([name], success)
            dur.add_metric([name], time.perf_counter() - t)
        return out + [ok, dur]


class MapCollector(Collector):
    """Kernel memory, entries and capacity of nettap's BPF maps.

    Memory is the map's ``memlock`` from /proc/self/fdinfo (what the kernel
    charges for it). Entries are reported where they are known without
    walking a map: arrays are full by construction, the target maps hold
    what nettap wrote, and capture_conns has a live counter in the kernel.
    Inserts the kernel refused are counted in the kernel for the maps that
    capture depends on (bpf/tcp.h NETTAP_MAP_*)."""

    SPECS = [
        (GaugeMetricFamily, "nettap_bpf_map_memory_bytes", "Kernel memory of each nettap BPF map (fdinfo memlock).",
         ["map"]),
        (GaugeMetricFamily, "nettap_bpf_map_entries",
         "Entries in use in each nettap BPF map, where known without a walk.", ["map"]),
        (GaugeMetricFamily, "nettap_bpf_map_max_entries", "Capacity of each nettap BPF map (for rings: bytes).",
         ["map"]),
        (CounterMetricFamily, "nettap_bpf_map_insert_failures",
         "Inserts the kernel refused (the map full, or no memory), in the maps whose entries capture depends on.",
         ["map"]),
    ]
    ARRAY_TYPES = (2, 6)           # BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY
    GROWING_TYPES = (1, 29)        # HASH (not preallocated), TASK_STORAGE: memory changes

    def __init__(self, map_fds: Callable[[], Dict[str, int]], map_info: Callable[[], Dict[str, tuple]],
                 known_entries: Callable[[], Dict[str, int]],
                 insert_failures: Callable[[], Dict[str, int]] = dict):
        self.map_fds = map_fds
        self.map_info = map_info
        self.known_entries = known_entries
        self.insert_failures = insert_failures
        self._static_mem: Dict[int, int] = {}     # fd -> memlock of maps whose size is fixed

    def describe(self) -> Iterable[Metric]:
        return _families(self.SPECS)

    def _memlock(self, fd: int, mtype: int) -> int:
        if fd in self._static_mem:
            return self._static_mem[fd]
        from exporter.kernel.fdinfo import parse_fdinfo
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mem = int(parse_fdinfo(f.read()).get("memlock", 0))
        if mtype not in self.GROWING_TYPES:
            self._static_mem[fd] = mem
        return mem

    def collect(self) -> Iterable[Metric]:
        mem, entries, cap, failures = _families(self.SPECS)
        known = self.known_entries()
        info = self.map_info()
        for name, fd in sorted(self.map_fds().items()):
            mtype, _, _, max_entries = info[name]
            mem.add_metric([name], self._memlock(fd, mtype))
            cap.add_metric([name], max_entries)
            if name in known:
                entries.add_metric([name], known[name])
            elif mtype in self.ARRAY_TYPES:
                entries.add_metric([name], max_entries)
        for name, n in sorted(self.insert_failures().items()):
            failures.add_metric([name], n)
        return [mem, entries, cap, failures]


class ReloadCollector(Collector):
    """Config (re)loads: the last result, the time of the last success, counts."""

    def __init__(self, state):
        self.state = state

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families():
        return [GaugeMetricFamily("nettap_config_last_reload_successful", "1 if the last config load succeeded."),
                GaugeMetricFamily("nettap_config_last_reload_success_timestamp_seconds",
                                  "Time of the last successful config load."),
                CounterMetricFamily("nettap_config_reloads", "Config loads, by result.", labels=["result"]),
                GaugeMetricFamily("nettap_config_restart_pending",
                                  "1 while the config in force asks for a change that applies only at the next start.")]

    def collect(self) -> Iterable[Metric]:
        ok, ts, n, pending = self._families()
        ok.add_metric([], 1 if self.state.last_ok else 0)
        ts.add_metric([], self.state.last_success)
        n.add_metric(["success"], self.state.successes)
        n.add_metric(["failure"], self.state.failures)
        pending.add_metric([], 1 if self.state.restart_pending else 0)
        return [ok, ts, n, pending]
