"""The running collector: probes, capture targets, rings, pipeline, the
stats switch and the metrics registry, wired together, with one way to
apply a config at run time."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from prometheus_client import CollectorRegistry
from prometheus_client import gc_collector, platform_collector, process_collector

from exporter import __version__
from exporter import config as config_mod
from exporter.capture import filter as capture_filter, kube, kubelines, members, sinks, targets
from exporter.kernel.bpfstats import STATE_PROBE, StatsSwitch, own_programs
from exporter.metrics.cgroup import CgroupCollector
from exporter.metrics.programs import ProgramStatsCollector
from exporter.metrics.tls import TlsFilesCollector
from exporter.metrics.buildinfo import BuildInfoCollector
from exporter.metrics.dns import DnsCollector
from exporter.metrics.guarded import Guarded
from exporter.metrics.kubernetes import KubernetesCollector
from exporter.metrics.lifecycle import LifecycleCollector
from exporter.metrics.maps import MapCollector
from exporter.metrics.pipeline import PipelineCollector
from exporter.metrics.probes import ProbeCollector
from exporter.metrics.reload import ReloadCollector
from exporter.metrics.targets import TargetsCollector
from exporter.config import Config, ConfigError
from exporter.kernel import tcp_h
from exporter.kernel.loader import Probes, load_at_start, records_at_start
from exporter.kernel.maps import PerCpuArray, lookup
from exporter.kernel.nodewalk import NodeWalk
from exporter.capture.dns import LATENCY_BUCKETS, DnsTracker
from exporter.capture.pipeline import Pipeline
from exporter.capture.records import ERRNO_NAMES, PROBE_COUNTER_FIELDS, PROBES, RINGS, TCP_STATES
from exporter.capture.ringbuf import RingMemory

log = logging.getLogger(__name__)


@dataclass
class ReloadState:
    last_ok: bool = True
    last_success: float = 0.0
    successes: int = 0
    failures: int = 0
    last_error: str = ""
    last_failure: float = 0.0
    restart_pending: str = ""     # what the config in force asks for that applies only at the next start


class Nettap:
    """Load everything a Config asks for; :meth:`apply` later configs at run
    time; :meth:`close` releases everything (no kernel state stays)."""

    def __init__(self, config: Config, mechanism: Optional[str] = None, probes: Optional[Probes] = None,
                 variant: Optional[str] = None, log_level: Optional[str] = None):
        """probes: already loaded and attached for this config (the CLI
        attaches first, before importing what only the pipeline needs).
        log_level: --log.level, in force over every config's log_level."""
        self.config = config
        self.log_level = log_level
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self.reloads = ReloadState()
        self.stats_switch = StatsSwitch(kernel_on=STATE_PROBE.on)
        self.node_walk = NodeWalk()             # scope node's walk: the iterator loads at its first scrape
        self.probes = probes or Probes(ring_sizes=config.ring_bytes, mechanism=mechanism, variant=variant,
                                        dns_now=load_at_start(config.dns), tls_now=load_at_start(config.tls),
                                        records=records_at_start(config.kinds))
        self.pipeline: Optional[Pipeline] = None
        self.rings: Dict[str, RingMemory] = {}
        self.sink_totals = sinks.Totals()       # shared by every sink: counters never reset
        self.target_watch: Optional[capture_filter.TargetWatch] = None
        self.dns = DnsTracker(drops=lambda: self._drops.sum(RINGS.index("dns"))[""])
        self.kube = kube.Node()                 # the node's pods (configured by apply)
        self.kube_watch: Optional[kube.Watch] = None
        self.workloads: Optional[kubelines.Workloads] = None
        try:
            fds = self.probes.map_fds
            self.target_maps = capture_filter.TargetMaps(fds, self.probes.map_info)
            self._counters = PerCpuArray(fds["probe_counters"], len(PROBE_COUNTER_FIELDS), PROBE_COUNTER_FIELDS)
            self._drops = PerCpuArray(fds["ringbuf_drops"], 1)
            self._insert_failures = PerCpuArray(fds["map_insert_failures"], 1)
            self._obs = PerCpuArray(fds["obs_counters"], tcp_h.OBS_ROWS)
            # Without a sink the capture rings are counted, not copied out.
            keep = config.output.type != "none"
            self.rings = {r: RingMemory(r, fds[r], self.probes.map_info[r][3],
                                        copy=keep or r in ("logs", "dlopen", "dns")) for r in RINGS}
            self.apply(config)
            self.target_watch = capture_filter.TargetWatch(self.target_maps, self._lock).start()
            self.pipeline = Pipeline(self.rings, self._open_sink(config.output), config.output.queue_bytes,
                                     drops=self.drops, watch={"dlopen": self._libssl_mapped,
                                                              "dns": self.dns.observe}, edit=self._kube_edits())
            self.pipeline.start()
            self.ready.set()
        except BaseException:
            self.close()
            raise

    # -- reading the kernel --
    def counters(self) -> Dict[str, Dict[str, int]]:
        return {p: self._counters.sum(i) for i, p in enumerate(PROBES)}

    def drops(self) -> Dict[str, int]:
        return {r: self._drops.sum(i)[""] for i, r in enumerate(RINGS)}

    def map_insert_failures(self) -> Dict[str, int]:
        """Inserts the kernel refused, per map that counts them (bpf/tcp.h NETTAP_MAP_*)."""
        return {m: self._insert_failures.sum(i)[""] for i, m in enumerate(tcp_h.MAPS)}

    def obs_counts(self) -> list:
        """The obs_counters rows (NETTAP_OBS_*), summed over CPUs: OBS_ROWS
        ints; with what user space counts in rows no program writes (the
        entries forgotten as their programs detached: kernel/followed.py)."""
        rows = self._obs.read(0)
        for row, n in self.probes.forgotten.items():
            rows[row] += n
        return rows

    def known_map_entries(self) -> Dict[str, int]:
        cur = self.target_maps.current
        live = lookup(self.probes.map_fds["capture_conns_live"], b"\0\0\0\0", 8)
        return {"capture_pids": len(cur.pids), "capture_cgroups": len(cur.cgroups),
                "capture_netns": len(cur.netns),
                "capture_conns": int.from_bytes(live, "little", signed=True) if live else 0}

    def stats(self) -> dict:
        """The /stats document: the probe counters, drops and drained
        records, each program's kernel statistics (runs and run time only
        while bpfStats is on), and the process footprint, as /metrics has them."""
        wanted = self.stats_switch.wanted
        programs = {p: {"misses": m, **({"runs": cnt, "run_time_seconds": ns / 1e9} if wanted else {})}
                    for p, (cnt, ns, m) in own_programs(self.probes.prog_fds).items()}
        # The client library's process collector, samples without the process_ prefix.
        process = {s.name[len("process_"):]: s.value
                   for fam in process_collector.ProcessCollector(registry=None).collect() for s in fam.samples}
        return {"probes": {p: {"calls": c["calls"], "returns": c["returns"],
                               "bytes_processed": c["bytes"], "chunks_published": c["chunks"]}
                           for p, c in self.counters().items()},
                "ringbuf_drops": self.drops(),
                "ringbuf_records_drained": self.pipeline.drained if self.pipeline else {},
                "bpf_stats_enabled": self.stats_switch.wanted,
                "bpf_programs": programs,
                "process": process}

    def landing(self, config_path: Optional[str] = None) -> dict:
        """The landing page's document (exporter/web/landing.py renders it)."""
        r, cur, probes = self.reloads, self.target_maps.current, self.probes
        drops = self.drops()
        return {
            "version": __version__,
            "variant": probes.variant,
            "config": {"path": config_path, "last_ok": r.last_ok, "last_success": r.last_success,
                       "last_failure": r.last_failure, "error": r.last_error,
                       "successes": r.successes, "failures": r.failures},
            "captures": [{"kind": t.kind, "value": str(t.value) if t.kind == "kubernetes" else t.value,
                          "gone": (t.kind, t.value) in cur.gone}
                         for t in self.config.captures],
            # As nettap_probe_attached reports them (metrics.pipeline.PipelineCollector).
            "probes": [{"probe": p, "mechanism": st.reported,
                        "attached": st.attached, "error": st.error}
                       for p, st in probes.all_states().items()],
            "rings": [{"ring": name, "capacity": ring.size, "pending": ring.pending_bytes(),
                       "drops": drops.get(name, 0)} for name, ring in self.rings.items()],
            "bpf_stats": {"wanted": self.stats_switch.wanted, "source": self.stats_switch.source(),
                          "scope": self.config.bpf_stats_scope},
        }

    def not_ready(self) -> Optional[str]:
        """None when ready; else why not (for /readyz)."""
        if not self.ready.is_set() or not self.pipeline or not self.pipeline.running:
            return "starting"
        missing = [p for p, s in self.probes.states.items() if not s.attached]
        if len(missing) == len(self.probes.states):
            return "no probe attached: " + "; ".join(self.probes.states[p].error for p in missing)
        return None

    # -- configuration --
    def apply(self, config: Config) -> None:
        """Make config the one in force. Everything that can be refused is
        checked first (raises ConfigError, and then nothing changed)."""
        with self._lock:                # shared with the target watch, which drops gone targets
            kube_was = (self.kube.settings, self.kube.watching)
            self.kube.configure(config.kube, any(t.kind == "kubernetes" for t in config.captures))
            try:
                self._apply_locked(config)
            except BaseException:
                if kube_was[0] is not None:        # a refused config's settings do not stay
                    self.kube.configure(*kube_was)
                raise
        self._kube_follow(config)

    def _apply_locked(self, config: Config) -> None:
        """apply()'s work, the lock held."""
        resolved = targets.resolve(config.captures, previous=self.target_maps.current, kube=self.kube)
        self.target_maps.check(resolved)
        old = self.config
        sink = None
        pending = []
        if self.pipeline and config.output._replace(queue_bytes=0) != old.output._replace(queue_bytes=0):
            if (config.output.type == "none") != (old.output.type == "none"):
                log.warning("output: switching between a sink and none takes effect at the next start")
                pending.append("output")
            else:
                sink = self._open_sink(config.output)      # refused here, before anything changed
        try:
            try:
                self.stats_switch.set(config.bpf_stats_enabled)
            except OSError as e:
                raise ConfigError(f"diagnostics.bpfStats.enabled: cannot switch statistics on: {e}") from None
            changed = {r: n for r, n in config.ring_bytes.items() if old.ring_bytes.get(r) != n}
            if changed:
                # A BPF ring's size is fixed when its map is created; only a restart
                # (new maps) changes it. The rest of the config applies now.
                log.warning("rings: %s take effect at the next start (a ring cannot be resized while loaded); "
                            "running with %s", ", ".join(f"{r} {old.ring_bytes.get(r)} -> {n} bytes"
                                                         for r, n in changed.items()),
                            ", ".join(f"{r} {old.ring_bytes[r]}" for r in changed))
                pending.extend(f"rings.{r}" for r in changed)
            # the programs the kinds asked for attached first: they are
            # there before any socket is decided with them
            if self.probes.sep.records is not None:     # (None: all attached for good)
                self.probes.set_records(config.kinds)
            self.target_maps.apply(resolved, config.max_payload_bytes,
                                   capture_filter.wakeup_thresholds(old.ring_bytes), config.kinds,
                                   config.sample)
            # TLS uprobes on or off; when on, on the libssl files of the
            # processes started since the last look too
            self.probes.set_tls(config.tls, self._tls_processes if config.tls_attach == "targets" else None)
            self.probes.set_dns(config.dns)
        except BaseException:
            if sink:
                sink.close()
            raise
        if self.pipeline:
            self.pipeline.queue_bytes = config.output.queue_bytes     # from the next batch on
        if sink:
            self.pipeline.replace_sink(sink)
        logging.getLogger().setLevel((self.log_level or config.log_level).upper())
        self.config = config._replace(rings=old.rings)    # rings: as loaded
        self.reloads.restart_pending = ", ".join(pending)

    # -- Kubernetes --
    def _kube_edits(self) -> dict:
        """The pipeline's edits of lines: owner lines' pods where this node
        has any (or a kubelet, or a kubernetes target), and the workloads'
        counts with metrics.kubernetes_labels."""
        node = self.kube
        if not (node.present or node.kubelet is not None or node.watching or self.workloads):
            return {}
        if self.config.output.type == "none" and not self.workloads:
            return {}           # no lines to name pods in: without a sink only the counts need them
        lines = kubelines.Lines(node, self.workloads)
        return {"obs_events": lines.obs_events, **({"capture_eof": lines.capture_eof} if self.workloads else {})}

    def _kube_follow(self, config: Config) -> None:
        """After an apply: the workloads' counts as asked, the lines' edits,
        and the watch once something needs the pods kept fresh."""
        k = config.kube
        if k.kubernetes_labels and self.workloads is None:
            self.workloads = kubelines.Workloads(k.kubernetes_max_series)
        elif not k.kubernetes_labels:
            self.workloads = None
        if self.workloads is not None:
            self.workloads.max_series = k.kubernetes_max_series
        if self.pipeline:
            self.pipeline.edit = self._kube_edits()
        if self.kube_watch is None and (self.kube.kubelet is not None or self.kube.watching):
            self.kube_watch = kube.Watch(self.kube, self._kube_changed).start()

    def _kube_changed(self) -> None:
        """The node's pods changed (the kube watch): the kubernetes targets'
        cgroups matched again into the kernel's filter; the other targets
        stay as resolved at the last apply."""
        with self._lock:
            cur = self.target_maps.current
            try:
                new = targets.with_kubernetes(cur, self.config.captures, self.kube)
                if new != cur or new.matched != cur.matched:
                    self.target_maps.reapply(new)
            except (ConfigError, OSError) as e:
                self.kube.update_failures += 1
                log.error("kubernetes: the targets' cgroups changed and the kernel's filter could not follow "
                          "(%d times so far): %s", self.kube.update_failures, e)

    def _tls_processes(self):
        """capture.tls_attach: targets: the pids of the targets' processes (the
        TLS uprobes go on the files they use), or None while a port target is
        in force (it names no process before its socket exists: any process's
        files, as with node)."""
        current = self.target_maps.current
        if current is None or current.ports:
            return None
        return members.processes(current, more_cgroups=self.kube.paths(current.cgroups))

    def _libssl_mapped(self, recs) -> None:
        """dlopen records (the drain thread): the TLS uprobes on the libssl
        files those processes map, where not attached yet, by TLS's own
        thread (the drain never opens a file nor waits on the config lock)."""
        self.probes.tls_mapped(sorted(set(recs["pid"].tolist())))

    def _open_sink(self, output) -> Optional[sinks.Sink]:
        """The sink for output, opened: a path nettap cannot (or must not)
        write refuses the config, rather than losing every record later."""
        sink = sinks.make(output, self.sink_totals)
        if sink:
            try:
                sink.open()
            except OSError as e:
                sink.close()
                raise ConfigError(f"output.path: {e}") from None
        return sink

    def reload(self, path: str) -> bool:
        """Load path and apply it; on any refusal keep the config in force,
        log one line naming the key and the reason, and count the failure."""
        try:
            # Parsed in a child process: scrapes never wait for the parse.
            self.apply(config_mod.load_apart(path))
        except config_mod.Cancelled as e:
            log.info("config reload abandoned: %s", e)
            return False
        except Exception as e:
            why = str(e) if isinstance(e, (ConfigError, OSError)) else f"{type(e).__name__}: {e}"
            self.reloads.last_ok = False
            self.reloads.failures += 1
            self.reloads.last_error = why
            self.reloads.last_failure = time.time()
            log.error("config reload refused, previous config stays in force: %s", why)
            return False
        self.reloads.last_ok = True
        self.reloads.successes += 1
        self.reloads.last_success = time.time()
        log.info("config loaded from %s", path)
        return True

    def mark_loaded(self) -> None:
        """Count the config the process started with as a successful load."""
        self.reloads.successes += 1
        self.reloads.last_success = time.time()

    def registry(self, with_process: bool = True) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=False)
        if with_process:
            process_collector.ProcessCollector(registry=reg)
            platform_collector.PlatformCollector(registry=reg)
            gc_collector.GCCollector(registry=reg)
        reg.register(Guarded({
            "probes": ProbeCollector(self.counters, self.drops),
            "lifecycle": LifecycleCollector(self.obs_counts, TCP_STATES, ERRNO_NAMES),
            "dns": DnsCollector(self.dns.snapshot, LATENCY_BUCKETS),
            "pipeline": PipelineCollector(self),
            "programs": ProgramStatsCollector(self.stats_switch, lambda: self.probes.prog_fds,
                                              lambda: self.config.bpf_stats_scope,
                                              node_walk=self.node_walk.programs),
            "maps": MapCollector(lambda: self.probes.map_fds, lambda: self.probes.map_info,
                                 self.known_map_entries, self.map_insert_failures),
            "cgroup": CgroupCollector(),
            "targets": TargetsCollector(self.target_maps, lambda: self.kube.update_failures),
            "kubernetes": KubernetesCollector(self.kube, lambda: self.workloads,
                                              lambda: self.pipeline.edit_failures if self.pipeline else 0),
            "config": ReloadCollector(self.reloads),
            "tls": TlsFilesCollector(self.probes.tls_counts),
            "build": BuildInfoCollector(),
        }))
        return reg

    def close(self) -> None:
        self.ready.clear()
        # Detach first: once no program runs, the pipeline's last drain
        # reads every record that will ever be published, so each one is
        # written or counted lost (not left in a ring nobody reads). Under
        # the lock: a reload may be switching TLS on or off.
        with self._lock:
            self.probes.detach()
        if self.target_watch:
            self.target_watch.stop()
            self.target_watch = None
        if self.kube_watch:
            self.kube_watch.stop()
            self.kube_watch = None
        self.kube.close()
        if self.pipeline:
            self.pipeline.stop()
            self.pipeline = None
        for r in self.rings.values():
            r.close()
        self.rings = {}
        self.stats_switch.close()
        self.node_walk.close()
        self.probes.close()


__all__ = ["Nettap", "ConfigError"]
