"""``nettap_bpf_program_*`` and ``nettap_node_bpf_program_*``: the kernel's
BPF run-time statistics of nettap's programs and, in scope node, of every
program on the node (exporter/kernel/bpfstats.py reads them), with the
statistics switch's state.

In scope node each program's holder is named from a /proc scan that is
refreshed only when a program id appears that it has not seen (a scan reads
every process's fd links); programs with equal labels are summed.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from exporter.kernel import bpfstats, fdinfo
from exporter.kernel.bpfstats import StatsSwitch


class ProgramStatsCollector(Collector):
    """``nettap_bpf_program_*`` (own programs) and, in node scope,
    ``nettap_node_bpf_program_*``; present only while stats are wanted."""

    def __init__(self, switch: StatsSwitch, prog_fds: Callable[[], Dict[str, int]],
                 scope: Callable[[], str], proc_root: str = "/proc",
                 node_walk: Optional[Callable[[], list]] = None):
        self.switch = switch
        self.node_walk = node_walk
        self._node_labels: Dict[Tuple[bytes, int, str], Dict[str, str]] = {}
        self.prog_fds = prog_fds
        self.scope = scope
        self.proc_root = proc_root
        self._holders: Dict[int, fdinfo.Holder] = {}
        self._seen_ids: set = set()

    def describe(self) -> Iterable[Metric]:
        return (self._own_families() + self._node_families() + self._switch_families()
                + [self._misses_family()])

    @staticmethod
    def _misses_family() -> Metric:
        return CounterMetricFamily(
            "nettap_bpf_program_misses",
            "Runs of each nettap eBPF program the kernel skipped because the program was already running "
            "on that CPU (recursion, or preemption on PREEMPT_RT): what they would have captured is lost.",
            labels=["program"])

    @staticmethod
    def _own_families() -> List[Metric]:
        return [CounterMetricFamily("nettap_bpf_program_runs",
                                    "Executions of each nettap eBPF program (only while bpfStats is on).",
                                    labels=["program"]),
                CounterMetricFamily("nettap_bpf_program_run_time_seconds",
                                    "Cumulative kernel run time of each nettap eBPF program "
                                    "(only while bpfStats is on).", labels=["program"])]

    @staticmethod
    def _node_families() -> List[Metric]:
        labels = ["program", "type", "owner"]
        return [CounterMetricFamily("nettap_node_bpf_program_runs",
                                    "Executions of every eBPF program on the node, summed over programs with "
                                    "equal labels (bpfStats on, scope node).", labels=labels),
                CounterMetricFamily("nettap_node_bpf_program_run_time_seconds",
                                    "Kernel run time of every eBPF program on the node (bpfStats on, scope node).",
                                    labels=labels),
                GaugeMetricFamily("nettap_node_bpf_programs", "eBPF programs loaded on the node (scope node).",
                                  labels=["type", "owner"])]

    @staticmethod
    def _switch_families() -> List[Metric]:
        return [GaugeMetricFamily("nettap_bpf_stats_enabled",
                                  "1 while the kernel's BPF run-time statistics are on, by anyone's doing "
                                  "(asked of the kernel: a probe program's run is counted)."),
                GaugeMetricFamily("nettap_bpf_stats_source",
                                  "1 for who holds BPF statistics on: fd (this nettap holds BPF_ENABLE_STATS), "
                                  "sysctl (this nettap set kernel.bpf_stats_enabled), external (another process: "
                                  "its own BPF_ENABLE_STATS fd, e.g. another nettap, or the sysctl).",
                                  labels=["source"])]

    def collect(self) -> Iterable[Metric]:
        enabled, source = self._switch_families()
        src = self.switch.source()
        enabled.add_metric([], 1 if src else 0)
        if src:
            source.add_metric([src], 1)
        misses = self._misses_family()
        own = sorted(bpfstats.own_programs(self.prog_fds()).items())
        for name, (_, _, n) in own:
            misses.add_metric([name], n)
        out: List[Metric] = [enabled, source, misses]
        if not self.switch.wanted:
            return out
        runs, rt = self._own_families()
        for name, (cnt, ns, _) in own:
            runs.add_metric([name], cnt)
            rt.add_metric([name], ns / 1e9)
        out += [runs, rt]
        if self.scope() == "node":
            out += self._node()
        return out

    @staticmethod
    def _labels_of(key: Tuple[bytes, int, str]) -> Dict[str, str]:
        """A node program's labels, kept from one scrape to the next: the
        two series of a program share them (nobody changes a sample's)."""
        name, ptype, owner = key
        return {"program": name.decode(errors="replace"), "type": fdinfo.prog_type_name(ptype), "owner": owner}

    def _node(self) -> List[Metric]:
        progs = bpfstats.node_programs(None, self.node_walk)
        ids = {p[0] for p in progs}
        if not ids <= self._seen_ids:       # new programs: who holds them?
            self._holders = fdinfo.scan_bpf_holders(self.proc_root)
            self._seen_ids = ids
        agg: Dict[Tuple[bytes, int, str], List[int]] = {}
        for pid_, name, ptype, cnt, ns in progs:
            h = self._holders.get(pid_)
            key = (name or f"id{pid_}".encode(), ptype, h.comm if h else "none")
            a = agg.get(key)
            if a is None:
                agg[key] = [cnt, ns, 1]
            else:
                a[0] += cnt
                a[1] += ns
                a[2] += 1
        runs, rt, count = self._node_families()
        per_owner: Dict[Tuple[str, str], int] = defaultdict(int)
        kept, labelled = self._node_labels, {}
        runs_name, rt_name = runs.name + "_total", rt.name + "_total"
        for key, (cnt, ns, k) in sorted(agg.items()):
            labels = labelled[key] = kept.get(key) or self._labels_of(key)
            runs.samples.append(Sample(runs_name, labels, cnt))
            rt.samples.append(Sample(rt_name, labels, ns / 1e9))
            per_owner[(labels["type"], labels["owner"])] += k
        self._node_labels = labelled        # the last scrape's (programs that go are forgotten)
        for (ptype, owner), k in sorted(per_owner.items()):
            count.add_metric([ptype, owner], k)
        return [runs, rt, count]
