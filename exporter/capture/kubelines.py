"""Pods and containers on the captured lines, and counted by workload.

The owner line (one a connection) gains, where its cgroup is a pod's (or
its container's), ``pod_uid`` and ``container_id``, and where the kubelet's
list has them ``namespace``, ``pod`` and ``container``: keys in byte order,
as every line's (docs/records.md). The compiled writer formats the lines
(exporter/capture/records.py); :class:`Lines` edits only the owner lines of a
batch, found by their ``"type":"owner"`` (a string's quote is always escaped
inside a value, so the markers below cannot occur within one), with the
cgroup's text rendered once and cached.

With ``metrics.kubernetes_labels``, :class:`Workloads` counts by (namespace,
pod, container) what the lines say of captured connections: each owner line
is a connection, its eof line its captured calls and bytes, its reset lines
its resets; the series are capped (the rest folded into one, counted).
"""
from __future__ import annotations

import json
import re
import threading

OWNER = b'"type":"owner"'
RESET = b'"type":"reset"'
_CONN = re.compile(rb',"conn_id":(\d+),')
_PID = re.compile(rb',"pid":(\d+),')
_TS = re.compile(rb',"ts_ns":(\d+),')
_EOF = re.compile(rb'"conn_id":(\d+),.*?"rx_bytes":(\d+),"rx_calls":(\d+),.*?"tx_bytes":(\d+),"tx_calls":(\d+),')
_RESET = re.compile(rb'\{"conn_id":(\d+),.*?"direction":"(egress|ingress)"')
MAX_CACHED = 1 << 14        # cgroups whose text is kept
MAX_CONNS = 1 << 16         # connections whose owner's workload is kept until their eof
FIELDS = ("connections", "tx_bytes", "rx_bytes", "tx_calls", "rx_calls", "resets_sent", "resets_received")
OTHER = ("", "other", "")   # the series the cap folds the rest into


def _s(v: str) -> bytes:
    return json.dumps(v, ensure_ascii=False).encode()


def _lines(data: bytes, marker: bytes):
    """(start, end) of each line of data holding marker (end after its newline)."""
    i = data.find(marker)
    while i >= 0:
        start, end = data.rfind(b"\n", 0, i) + 1, data.find(b"\n", i)
        end = len(data) if end < 0 else end + 1
        yield start, end
        i = data.find(marker, end)


class Workloads:
    """Counts by (namespace, pod, container): written by the drain thread,
    read by scrapes (snapshot)."""

    def __init__(self, max_series: int):
        self.max_series = max_series
        self.series: dict = {}               # key -> [FIELDS...]
        self.uids: dict = {}                 # key -> the pod UID of its last owner line (forget_pods)
        self.conns: dict = {}                # conn_id -> key, until its eof
        self.early: dict = {}                # conn_id -> eof counts that came before its owner line
        self.folded = 0                      # records counted in OTHER because of the cap
        self.forgotten = 0                   # connections whose workload was forgotten (MAX_CONNS)
        self._lock = threading.Lock()

    def _row(self, key: tuple) -> list:
        """key's counts; once max_series exist, a new key's go to OTHER (one
        series more), each record so counted in folded."""
        row = self.series.get(key)
        if row is None:
            if len(self.series) >= self.max_series:
                self.folded += 1
                key, row = OTHER, self.series.get(OTHER)
            if row is None:
                row = self.series[key] = [0] * len(FIELDS)
        return row

    def owner(self, conn_id: int, key: tuple, pod_uid: str = "") -> None:
        """An owner line of key's; conn_id 0 (none, or unknown) is counted
        but not kept: its eof and reset lines cannot be told apart."""
        with self._lock:
            self._row(key)[0] += 1
            if pod_uid and key in self.series:
                self.uids[key] = pod_uid
            if not conn_id:
                return
            if len(self.conns) >= MAX_CONNS:
                del self.conns[next(iter(self.conns))]
                self.forgotten += 1
            self.conns[conn_id] = key
            early = self.early.pop(conn_id, None)
            if early:
                self._eof(key, early)

    def _eof(self, key: tuple, counts) -> None:
        row = self._row(key)
        rx_b, rx_c, tx_b, tx_c = counts
        row[1] += tx_b
        row[2] += rx_b
        row[3] += tx_c
        row[4] += rx_c

    def eof_lines(self, data: bytes) -> None:
        with self._lock:
            for m in _EOF.finditer(data):
                cid = int(m.group(1))
                if not cid:
                    continue
                counts = tuple(int(g) for g in m.groups()[1:])
                key = self.conns.pop(cid, None)
                if key is not None:
                    self._eof(key, counts)
                else:                        # its owner line not seen yet (another ring), or no pod's
                    if len(self.early) >= MAX_CONNS:
                        del self.early[next(iter(self.early))]
                    self.early[cid] = counts

    def reset_lines(self, data: bytes) -> None:
        with self._lock:
            for start, end in _lines(data, RESET):
                m = _RESET.match(data, start, end)
                cid = int(m.group(1)) if m else 0
                key = self.conns.get(cid) if cid else None
                if key is not None:
                    self._row(key)[5 if m.group(2) == b"egress" else 6] += 1

    def forget_pods(self, gone) -> int:
        """Drop the series (and open connections) of the pods that left:
        gone(uids) is the set of those uids known gone. Rollouts then do not
        fill metrics.kubernetes_max_series with pods that no longer exist."""
        with self._lock:
            left = gone(set(self.uids.values()))
            keys = {key for key, uid in self.uids.items() if uid in left}
            for key in keys:
                del self.series[key], self.uids[key]
            if keys:
                self.conns = {c: k for c, k in self.conns.items() if k not in keys}
            return len(keys)

    def snapshot(self) -> tuple:
        with self._lock:
            return {k: list(v) for k, v in self.series.items()}, self.folded, self.forgotten


class Lines:
    """The drain thread's edits of obs_events lines (and eof lines' counts)."""

    def __init__(self, node, workloads: Workloads | None = None):
        self.node, self.workloads = node, workloads
        self._texts: dict = {}               # cgroup id -> (the kubelet's list it was made from, texts)
        self.failures = 0                    # batches left as written because an edit failed

    def _texts_of(self, cid: int, line: bytes):
        """(before daddr, before netns, before saddr, workload key, pod UID) of a
        cgroup (each insertion with the key it goes before), or None when it
        is no pod's; kept per cgroup (but a v1 node's, by process)."""
        k = self.node.kubelet
        # a list replaced, a new kubelet, the cgroups changed
        gen = (id(k), k.generation if k is not None else 0, self.node.generation)
        hit = self._texts.get(cid)
        if hit is not None and hit[0] == gen:
            return hit[1]
        p, t = _PID.search(line), _TS.search(line)
        ident = self.node.identity(cid, int(p.group(1)) if p else 0, int(t.group(1)) if t else 0)
        texts = None
        if ident is not None:
            ns, pod, cont = self.node.names(ident)
            texts = ((b',"container":' + _s(cont) if cont else b"")
                     + (b',"container_id":' + _s(ident.container_id) if ident.container_id else b"") + b',"daddr":',
                     (b',"namespace":' + _s(ns) if ns else b"") + b',"netns":',
                     (b',"pod":' + _s(pod) if pod else b"") + b',"pod_uid":' + _s(ident.pod_uid) + b',"saddr":',
                     (ns, pod or ident.pod_uid, cont or ident.container_id), ident.pod_uid)
        cg = self.node.cgroups.get(cid)
        # the cgroup's (not a v1 node's process's, where cgroups name no pod): kept
        if cg is not None and cg.identity is ident or ident is None and self.node.cgroups and self.node.no_pods(cid):
            if len(self._texts) >= MAX_CACHED:
                self._texts.clear()
            self._texts[cid] = (gen, texts)
        return texts

    def owner(self, line: bytes) -> bytes:
        if not line.startswith(b'{"cgroup_id":'):
            return line
        texts = self._texts_of(int(line[13:line.index(b",", 13)]), line)
        if texts is None:
            return line
        a, b, c, key, uid = texts
        if self.workloads is not None:
            conn = _CONN.search(line)
            if conn:
                self.workloads.owner(int(conn.group(1)), key, uid)
        return line.replace(b',"daddr":', a, 1).replace(b',"netns":', b, 1).replace(b',"saddr":', c, 1)

    def obs_events(self, data: bytes) -> bytes:
        """A batch of obs_events lines, its owner lines with their pod."""
        out, done = [], 0
        find, rfind, owner = data.find, data.rfind, self.owner
        i = find(OWNER)
        while i >= 0:
            start, end = rfind(b"\n", 0, i) + 1, find(b"\n", i) + 1 or len(data)
            line = data[start:end]
            new = owner(line)
            if new is not line:
                out += (data[done:start], new)
                done = end
            i = find(OWNER, end)
        if self.workloads is not None:
            self.workloads.reset_lines(data)
        if not out:
            return data
        out.append(data[done:])
        return b"".join(out)

    def capture_eof(self, data: bytes) -> bytes:
        if self.workloads is not None:
            self.workloads.eof_lines(data)
        return data


def pod_text(r: dict) -> str:
    """An owner line's pod and container (docs/kubernetes.md), "" when it has none."""
    if not isinstance(r.get("pod_uid"), str):
        return ""
    pod = f"{r['namespace']}/{r['pod']}" if isinstance(r.get("pod"), str) and "namespace" in r else ""
    text = f"pod {pod} (uid {r['pod_uid']})" if pod else f"pod uid {r['pod_uid']}"
    if isinstance(r.get("container_id"), str):
        name = r.get("container")
        text += f", container {name} (id {r['container_id'][:12]})" if isinstance(name, str) \
            else f", container id {r['container_id'][:12]}"
    return text
