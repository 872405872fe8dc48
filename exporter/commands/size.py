"""``nettap size``: requests and limits from nettap's own series in Prometheus.

Every figure is one instant query at one evaluation time over the range
(``max_over_time``, ``quantile_over_time`` of a ``rate`` subquery,
``increase``), grouped by ``instance``, and kept to the targets that expose
``nettap_build_info``; the rules that turn figures into requests are the
``*_RULE`` texts below, printed with the figures so a reader can redo them.

The capture and nettap ingest are sized apart, each from its own process's
series: both serve ``nettap_build_info``, ``process_*`` and ``nettap_cgroup_*``;
the ingest's targets are those that also serve ``nettap_ingest_connected``
(whatever their job label), the capture's are the others.

A DaemonSet has one pod spec for every node: the patch (``-o yaml``) and the
Helm values (``-o helm``) take, for each container and resource, the largest
of the per-node answers.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, List, Optional, Sequence

MiB = 1 << 20
MEM_HEADROOM = 1.25
MEM_RULE = ("request = the larger of peak RSS and peak cgroup usage + 25 %, rounded up to 16 MiB "
            "(the limit seen, when the OOM killer was invoked: the peak was held down by it); "
            "limit = 2 x request (room for the user-space queue under a burst the range may not hold)")
CPU_RULE = ("request = p95 of user CPU, rounded up to 5m (at least 10m); "
            "limit = 2 x the highest rate, rounded up to 50m (at least 100m: start-up and reloads), "
            "4 x when throttled in more than 1 % of CFS periods (the peak seen was held down by the limit)")
THROTTLED_HIGH = 0.01
CAPTURE, INGEST = "capture", "ingest"
CONTAINERS = {CAPTURE: "nettap", INGEST: "nettap-ingest"}      # the DaemonSet's containers
QUANTILES = (0.5, 0.95, 0.99)


class SizeError(Exception):
    pass


@dataclass
class Node:
    instance: str
    rss_peak: Optional[float] = None
    cgroup_peak: Optional[float] = None
    mem_limit: Optional[float] = None
    oom_kills: Optional[float] = None
    cpu: Dict[str, float] = field(default_factory=dict)       # p50, p95, p99, max (cores)
    periods: Optional[float] = None
    throttled_periods: Optional[float] = None
    throttled_seconds: Optional[float] = None
    drops: Optional[float] = None
    calls: Optional[float] = None
    bpf: Dict[str, float] = field(default_factory=dict)       # p50, p95, max (cores)
    bpf_coverage: Optional[float] = None                      # share of the range with run times
    role: str = CAPTURE                                       # or INGEST: nettap ingest's process

    # --- the rules
    def mem_peak(self) -> Optional[float]:
        seen = [v for v in (self.rss_peak, self.cgroup_peak) if v is not None]
        if self.oom_kills and self.mem_limit:
            seen.append(self.mem_limit)
        return max(seen) if seen else None

    def mem_request(self) -> Optional[int]:
        peak = self.mem_peak()
        return None if peak is None else _round_up(peak * MEM_HEADROOM, 16 * MiB)

    def mem_limit_suggested(self) -> Optional[int]:
        r = self.mem_request()
        return None if r is None else 2 * r

    def throttled_ratio(self) -> Optional[float]:
        if not self.periods or self.throttled_periods is None:
            return None
        return self.throttled_periods / self.periods

    def cpu_request(self) -> Optional[int]:
        """Millicores."""
        if "p95" not in self.cpu:
            return None
        return max(_round_up(self.cpu["p95"] * 1000, 5), 10)

    def cpu_limit(self) -> Optional[int]:
        if "max" not in self.cpu:
            return None
        factor = 4 if (self.throttled_ratio() or 0) > THROTTLED_HIGH else 2
        return max(_round_up(self.cpu["max"] * 1000 * factor, 50), 100, self.cpu_request() or 0)


def _round_up(v: float, step: int) -> int:
    # 1e-9: a figure exactly on a step stays there despite float noise
    return int(math.ceil(v / step - 1e-9) * step)


class Prometheus:
    def __init__(self, url: str, at: float, timeout: float = 30):
        import requests
        self.url, self.at, self.timeout = url.rstrip("/"), at, timeout
        self.session = requests.Session()
        self.not_finite: Dict[str, List[str]] = {}     # "NaN"/"+Inf"/"-Inf" -> "instance figure" not taken

    def vector(self, expr: str) -> Dict[str, float]:
        """{instance: value} of an instant query at self.at. SizeError, in
        one short line, for anything but Prometheus's answer to it."""
        import json
        from exporter.util.httpget import FetchError, get, shown
        try:
            raw = get(self.url + "/api/v1/query", {"query": expr, "time": self.at}, deadline=self.timeout,
                      session=self.session)
        except FetchError as e:
            raise SizeError(str(e)) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise SizeError(f"{self.url} did not answer with Prometheus's API (not JSON: "
                            f"{shown(raw[:400].decode('utf-8', 'replace'))})") from None
        if not isinstance(body, dict):
            raise SizeError(f"{self.url} did not answer with Prometheus's API (a JSON {type(body).__name__})")
        if body.get("status") != "success":
            raise SizeError(f"Prometheus refused {shown(expr)}: {shown(str(body.get('error', 'no error given')))}")
        try:
            return {str(r["metric"].get("instance", "")): float(r["value"][1])
                    for r in body["data"]["result"]}
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            raise SizeError(f"{self.url} did not answer with Prometheus's API (an instant vector's "
                            "data.result: [{metric: {...}, value: [time, \"number\"]}, ...])") from None


def measure(prom: Prometheus, rng: str, window: str, step: str, selector: str = "") -> List[Node]:
    """The capture's nodes, then the ingest's (each sorted by instance)."""
    sel = "{" + selector + "}"
    nettap = f"group by (instance) (last_over_time(nettap_build_info{sel}[{rng}]))"
    ingest = f"group by (instance) (last_over_time(nettap_ingest_connected{sel}[{rng}]))"
    if not prom.vector(nettap):
        raise SizeError(f"no nettap series (nettap_build_info{sel}) in Prometheus at {prom.url} "
                        f"over the {rng} to {_iso(prom.at)}")
    return (_measure(prom, CAPTURE, f"{nettap} unless on (instance) {ingest}", rng, window, step, sel)
            + _measure(prom, INGEST, f"{ingest} and on (instance) {nettap}", rng, window, step, sel))


def _measure(prom: Prometheus, role: str, group: str, rng: str, window: str, step: str, sel: str) -> List[Node]:
    """The figures of one role's targets (group: a query giving their instances)."""
    def q(expr: str) -> Dict[str, float]:
        return prom.vector(f"({expr}) and on (instance) ({group})")

    nodes = {i: Node(i, role=role) for i in prom.vector(group)}
    if not nodes:
        return []

    def put(attr: str, values: Dict[str, float], key: Optional[str] = None) -> None:
        for inst, v in values.items():
            if inst in nodes and not math.isfinite(v):      # 0/0, x/0: no figure, said by main
                spelt = "NaN" if math.isnan(v) else "+Inf" if v > 0 else "-Inf"
                prom.not_finite.setdefault(spelt, []).append(f"{inst} {attr}" + (f" {key}" if key else ""))
            elif inst in nodes:
                if key is None:
                    setattr(nodes[inst], attr, v)
                else:
                    getattr(nodes[inst], attr)[key] = v

    put("rss_peak", q(f"max by (instance) (max_over_time(process_resident_memory_bytes{sel}[{rng}]))"))
    put("cgroup_peak", q(f"max by (instance) (max_over_time(nettap_cgroup_memory_usage_bytes{sel}[{rng}]))"))
    put("mem_limit", q(f"max by (instance) (last_over_time(nettap_cgroup_memory_limit_bytes{sel}[{rng}]))"))
    put("oom_kills", q(f"sum by (instance) (increase(nettap_cgroup_memory_oom_kills_total{sel}[{rng}]))"))
    cpu = f"sum by (instance) (rate(process_cpu_seconds_total{sel}[{window}]))"
    for qt in QUANTILES:
        put("cpu", q(f"quantile_over_time({qt}, ({cpu})[{rng}:{step}])"), f"p{round(qt * 100)}")
    put("cpu", q(f"max_over_time(({cpu})[{rng}:{step}])"), "max")
    counters = [("periods", "nettap_cgroup_cpu_periods_total"),
                ("throttled_periods", "nettap_cgroup_cpu_throttled_periods_total"),
                ("throttled_seconds", "nettap_cgroup_cpu_throttled_seconds_total")]
    if role == CAPTURE:                 # the capture's own: its BPF programs, its rings and probes
        bpf = f"sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{sel}[{window}]))"
        for qt in (0.5, 0.95):
            put("bpf", q(f"quantile_over_time({qt}, ({bpf})[{rng}:{step}])"), f"p{round(qt * 100)}")
        put("bpf", q(f"max_over_time(({bpf})[{rng}:{step}])"), "max")
        put("bpf_coverage", q(f"count_over_time(({bpf})[{rng}:{step}]) / on (instance) "
                              f"count_over_time((group by (instance) (nettap_build_info{sel}))[{rng}:{step}])"))
        counters += [("drops", "nettap_ringbuf_drops_total"), ("calls", "nettap_probe_calls_total")]
    for attr, metric in counters:
        put(attr, q(f"sum by (instance) (increase({metric}{sel}[{rng}]))"))
    return sorted(nodes.values(), key=lambda n: n.instance)


def busiest(nodes: List[Node]) -> Node:
    """The node with the highest p95 user CPU (then the most probe calls)."""
    return max(nodes, key=lambda n: (n.cpu.get("p95", -1), n.calls or 0))


# ---- output

def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bytes(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.0f} B ({v / MiB:.1f} MiB)"


def _mcores(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.2f}m"


def _mem(v: Optional[int]) -> str:
    return "-" if v is None else f"{v // MiB}Mi"


def _cpu(v: Optional[int]) -> str:
    return "-" if v is None else f"{v}m"


def describe(n: Node, window: str) -> List[str]:
    out = [f"  memory  request {_mem(n.mem_request())}  limit {_mem(n.mem_limit_suggested())}",
           f"          peak RSS {_bytes(n.rss_peak)} (process_resident_memory_bytes)",
           f"          peak cgroup usage {_bytes(n.cgroup_peak)} (nettap_cgroup_memory_usage_bytes)",
           f"          OOM kills {_count(n.oom_kills)}; cgroup limit {_bytes(n.mem_limit) if n.mem_limit else 'none'}"]
    c = n.cpu
    out += [f"  cpu     request {_cpu(n.cpu_request())}  limit {_cpu(n.cpu_limit())}",
            f"          user CPU (rate of process_cpu_seconds_total over {window}): "
            + "  ".join(f"{k} {_mcores(c.get(k))}" for k in ("p50", "p95", "p99", "max"))]
    ratio = n.throttled_ratio()
    if n.periods is None:
        throttled = "throttling: not known (no nettap_cgroup_cpu_* series: cpu controller not readable)"
    elif not n.periods:
        throttled = "throttling: none possible (no CFS periods: no CPU limit on nettap's cgroup)"
    else:
        throttled = (f"throttled in {_count(n.throttled_periods)} of {_count(n.periods)} CFS periods "
                     f"({ratio * 100:.2f} %), {n.throttled_seconds or 0:.3f} s")
    out.append(f"          {throttled}" + (f"; ring drops {_count(n.drops)}" if n.role == CAPTURE else ""))
    if "p95" not in c:
        out.append(f"          no CPU rate: the rate window ({window}) must hold two scrapes (--window)")
    if n.role == INGEST:                # no BPF program of its own
        return out
    if n.bpf:
        b = n.bpf
        out += [f"  kernel  BPF time in nettap's programs (rate of nettap_bpf_program_run_time_seconds_total "
                f"over {window}): " + "  ".join(f"{k} {_mcores(b.get(k))}" for k in ("p50", "p95", "max")),
                f"          bpfStats on for {(n.bpf_coverage or 0) * 100:.0f} % of the range; "
                f"{_count(n.calls)} probe calls",
                "          charged to the processes making the TCP calls, never to nettap's container: "
                "leave that much node CPU unrequested (system-reserved), or narrow captures"]
    else:
        out += ["  kernel  BPF time in nettap's programs: not measured (bpfStats was off over the range)",
                "          measure it: set diagnostics.bpfStats.enabled: true in nettap's config (applies "
                "without a restart) for a busy hour, then run nettap size again over that hour; it is "
                "charged to the processes making the TCP calls, never to nettap's container"]
    return out


def _count(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.0f}"


def daemonset(nodes: List[Node]) -> Dict[str, Optional[int]]:
    """The one spec for every node: each resource's largest per-node answer."""
    def top(f):
        vals = [v for v in map(f, nodes) if v is not None]
        return max(vals) if vals else None
    return {"cpu_request": top(Node.cpu_request), "cpu_limit": top(Node.cpu_limit),
            "mem_request": top(Node.mem_request), "mem_limit": top(Node.mem_limit_suggested)}


def _roles(nodes: List[Node]) -> Dict[str, List[Node]]:
    """{role: its nodes}, capture first, of the roles that have any."""
    out = {role: [n for n in nodes if n.role == role] for role in CONTAINERS}
    return {role: ns for role, ns in out.items() if ns}


def _spec(d: Dict[str, Optional[int]]) -> str:
    return (f"requests cpu {_cpu(d['cpu_request'])} memory {_mem(d['mem_request'])}; "
            f"limits cpu {_cpu(d['cpu_limit'])} memory {_mem(d['mem_limit'])}")


def text(nodes: List[Node], prom_url: str, at: float, rng: str, window: str, step: str) -> str:
    roles = _roles(nodes)
    cap, ing = roles.get(CAPTURE, []), roles.get(INGEST, [])
    lines = [f"nettap size: {len(cap)} node(s)" + (f" and {len(ing)} nettap ingest(s)" if ing else "")
             + f", the {rng} to {_iso(at)} (rate window {window}, step {step}), from {prom_url}", ""]
    for n in cap:
        lines += [f"node {n.instance}"] + describe(n, window) + [""]
    if cap:
        b = busiest(cap)
        lines += [f"busiest node: {b.instance} (highest p95 user CPU): requests cpu {_cpu(b.cpu_request())} "
                  f"memory {_mem(b.mem_request())}; limits cpu {_cpu(b.cpu_limit())} "
                  f"memory {_mem(b.mem_limit_suggested())}",
                  f"DaemonSet (one spec for every node: the largest per-node figure): {_spec(daemonset(cap))}", ""]
    for n in ing:
        lines += [f"nettap ingest {n.instance}"] + describe(n, window) + [""]
    if ing:
        lines += [f"DaemonSet's nettap-ingest container (the largest per-node figure): {_spec(daemonset(ing))}", ""]
    lines += ["-o yaml prints it as a patch for deploy/kubernetes/daemonset.yaml, -o helm as values for "
              "deploy/helm/nettap", "", f"memory rule: {MEM_RULE}", f"cpu rule: {CPU_RULE}"]
    return "\n".join(lines) + "\n"


def resources(nodes: List[Node], what: str) -> Dict[str, dict]:
    """{role: requests and limits} for each role that has nodes: the one spec of each container."""
    out = {}
    for role, ns in _roles(nodes).items():
        d = daemonset(ns)
        if None in d.values():
            raise SizeError(f"not enough data for {what}: the {role}'s "
                            + ", ".join(k for k, v in d.items() if v is None) + " missing (see the text output)")
        out[role] = {"requests": {"cpu": _cpu(d["cpu_request"]), "memory": _mem(d["mem_request"])},
                     "limits": {"cpu": _cpu(d["cpu_limit"]), "memory": _mem(d["mem_limit"])}}
    return out


def _head(nodes: List[Node], prom_url: str, at: float, rng: str) -> str:
    roles = _roles(nodes)
    head = f"# nettap size: {len(roles.get(CAPTURE, []))} node(s)"
    if INGEST in roles:
        return head + f" and {len(roles[INGEST])} nettap ingest(s), the {rng} to {_iso(at)}, from {prom_url}\n"
    return (head + f", the {rng} to {_iso(at)}, from {prom_url}\n"
            "# No nettap ingest series (nettap_ingest_connected) over the range: its container is not sized.\n")


def yaml_patch(nodes: List[Node], prom_url: str, at: float, rng: str) -> str:
    import yaml
    res = resources(nodes, "a patch")
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": CONTAINERS[role], "resources": r} for role, r in res.items()]}}}}
    return (_head(nodes, prom_url, at, rng)
            + "# Strategic-merge patch for deploy/kubernetes/daemonset.yaml (containers merge by name):\n"
              "#   kubectl -n nettap patch daemonset nettap --patch-file THIS_FILE\n"
              "# or list it under patches: in deploy/kubernetes/kustomization.yaml.\n"
            + yaml.safe_dump(patch, sort_keys=False))


def helm_values(nodes: List[Node], prom_url: str, at: float, rng: str) -> str:
    """capture.resources and ingest.resources for deploy/helm/nettap: each container its own
    (they win over ebpf.nettap.resources, the one block for both)."""
    import yaml
    res = resources(nodes, "the values")
    return (_head(nodes, prom_url, at, rng)
            + "# Helm values for deploy/helm/nettap, each container from its own series:\n"
              "#   helm upgrade nettap deploy/helm/nettap --reuse-values -f THIS_FILE\n"
            + yaml.safe_dump({role: {"resources": r} for role, r in res.items()}, sort_keys=False))


def _args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nettap size", description="Requests and limits for nettap's pods from "
                                "nettap's own series in Prometheus, per node and for the busiest, with the "
                                "figures behind them.")
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus's base URL, e.g. http://prometheus:9090")
    p.add_argument("--range", dest="rng", default="7d", help="how far back to look (Prometheus duration; default 7d)")
    p.add_argument("--window", default="5m",
                   help="rate window for CPU figures; must hold two scrapes (default 5m)")
    p.add_argument("--step", default="1m", help="resolution of the CPU percentiles (default 1m)")
    p.add_argument("--selector", default="", metavar="LABELS",
                   help="extra label matchers for nettap's series, e.g. 'job=\"nettap\",cluster=\"eu1\"'")
    p.add_argument("--at", type=_when, metavar="TIME",
                   help="end of the range: unix seconds or UTC 2006-01-02T15:04:05Z (default: now)")
    p.add_argument("-o", "--output", choices=("text", "yaml", "helm"), default="text",
                   help="text (default); yaml: a patch for deploy/kubernetes/daemonset.yaml; helm: "
                   "capture.resources and ingest.resources for deploy/helm/nettap")
    return p.parse_args(argv)


def _when(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        pass
    try:
        return datetime.strptime(v, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: not unix seconds nor YYYY-MM-DDTHH:MM:SSZ") from None


def main(argv: Sequence[str]) -> int:
    a = _args(argv)
    at = a.at if a.at is not None else float(int(time.time()))
    prom = Prometheus(a.prometheus, at)
    try:
        nodes = measure(prom, a.rng, a.window, a.step, a.selector)
        if a.output == "text":
            out = text(nodes, a.prometheus, at, a.rng, a.window, a.step)
        else:
            out = (yaml_patch if a.output == "yaml" else helm_values)(nodes, a.prometheus, at, a.rng)
    except SizeError as e:
        out = None
        print(f"nettap size: {e}", file=sys.stderr)
    finally:
        for spelt, figures in prom.not_finite.items():
            print(f"nettap size: Prometheus answered {spelt} for {len(figures)} figure(s), taken as not known "
                  f"({', '.join(figures[:6])}{', ...' if len(figures) > 6 else ''})", file=sys.stderr)
    if out is None:
        return 1
    sys.stdout.write(out)
    return 0
