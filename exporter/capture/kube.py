"""Kubernetes on this node: which pod and container a cgroup is, and which
cgroups a ``kubernetes:`` target names.

:class:`Node` keeps the kubelet's cgroups (exporter/capture/kubecgroups.py,
cgroup id -> pod UID and container id) and, where the kubelet answers, its pod
list (exporter/capture/kubelet.py: names, labels, container names). A lookup
by cgroup id is a dict access; an id not seen yet makes one scan of the
kubelet's cgroups (at most one a second), and an id that a scan begun after
its lookup did not find is no pod's (cgroup ids are never reused).
:class:`Watch` keeps both fresh while something needs them: the cgroups every
``kubernetes.cgroup_poll_ms`` while a ``kubernetes:`` target is in force, the
pod list every ``kubernetes.poll_seconds`` (and within a second of a pod's
cgroup the list does not have), and calls ``on_change`` when what the targets
match may have changed: the daemon then matches the kubernetes targets again
into the kernel's filter.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from exporter.capture import kubecgroups
from exporter.capture.kubelet import Kubelet

log = logging.getLogger(__name__)

MIN_RESCAN = 1.0            # s between two scans a lookup makes (a scan: ~1 ms a hundred pods)
MAX_UNKNOWN = 1 << 16       # cgroup ids known to be no pod's, remembered (then forgotten all at once)
STOP_WAIT = 10.0            # s Watch.stop waits for each thread (a poll may take kubernetes.timeout_seconds: 60)


def kubelet_url(setting: str, env=os.environ) -> str | None:
    """kubernetes.kubelet_url as a URL, or None: auto is the node's kubelet,
    at NODE_IP (the downward API's status.hostIP: a pod may not resolve its
    node's name) or else NODE_NAME (spec.nodeName), where one is set."""
    if setting == "off":
        return None
    if setting == "auto":
        ip, name = env.get("NODE_IP", "").strip(), env.get("NODE_NAME", "").strip()
        if ":" in ip:
            ip = f"[{ip}]"                   # an IPv6 node
        return f"https://{ip or name}:10250/pods" if ip or name else None
    return setting


def cgroup_root(setting: str) -> tuple:
    """(the cgroup v2 directory the kubelet's cgroups are looked for in, its
    level), or (None, 0) where there is none."""
    from exporter.capture.targets import cgroup2_mounts, cgroup_id_level
    from exporter.config import ConfigError
    root = setting
    if setting == "auto":                # the mount with the kubelet's cgroups (in a pod: the host's, not its own)
        mounts = [m for m, _ in cgroup2_mounts()]
        if not mounts:
            return None, 0
        root = next((m for m in mounts if kubecgroups.kubepods_dirs(m)), mounts[0])
    try:
        return root, cgroup_id_level(root)[1]
    except (ConfigError, OSError) as e:
        log.warning("kubernetes: no pod's cgroup can be found: %s", e)
        return None, 0


class Node:
    """The pods of this node. identity(), match() from any thread; scan()
    and the settings from the watch's and the config's."""

    def __init__(self, settings=None, proc: str = "/proc", env=os.environ):
        self.proc, self.env = proc, env
        self.processes = kubecgroups.Processes(proc)     # a cgroup v1 node's owners
        self.settings = None
        self.kubelet: Kubelet | None = None
        self.cgroups: dict = {}              # cgroup id -> kubecgroups.Cgroup (replaced whole)
        self.pods: dict = {}                 # pod UID -> {cgroup id: Cgroup}
        self._unknown: set = set()
        self._pending: dict = {}             # cgroup id not found yet -> when first looked up (monotonic)
        self._pending_lock = threading.Lock()
        self._scanned_at = -MIN_RESCAN
        self._scan_lock = threading.Lock()
        self.scans = 0
        self.generation = 0                  # one more at each change of the cgroups
        self.update_failures = 0             # target updates the kernel's filter refused (counted, logged)
        self.root, self.root_level = None, 0
        self.present = False                 # the kubelet's cgroups are here (kubepods)
        self.watching = False                # a kubernetes target is in force
        self.wake_kubelet = None             # set by Watch: ask the kubelet now
        if settings is not None:
            self.configure(settings)

    def configure(self, settings, watching: bool = False) -> None:
        """The kubernetes: and metrics: sections in force (a changed kubelet
        setting makes a new client, the old one's list kept until it answers)."""
        old, self.settings, self.watching = self.settings, settings, watching
        kube_keys = ("kubelet_url", "token_file", "ca_file", "insecure_skip_verify", "timeout_seconds", "max_bytes")
        if old is None or any(getattr(old, k) != getattr(settings, k) for k in kube_keys):
            url = kubelet_url(settings.kubelet_url, self.env)
            previous, self.kubelet = self.kubelet, None
            if url:
                self.kubelet = Kubelet(url, settings.token_file, settings.ca_file, settings.insecure_skip_verify,
                                       settings.timeout_seconds, settings.max_bytes)
                if previous is not None:
                    self.kubelet.pods = previous.pods
                if self.wake_kubelet:            # asked now, not at the end of the old poll interval
                    self.wake_kubelet()
            else:
                log.info("kubernetes: no kubelet to ask (kubernetes.kubelet_url %s%s): pods are known by their "
                         "UIDs and containers by their ids only", settings.kubelet_url,
                         ", neither NODE_IP nor NODE_NAME set" if settings.kubelet_url == "auto" else "")
            if previous is not None:
                previous.close()
        if old is None or old.cgroup_root != settings.cgroup_root:
            self.root, self.root_level = cgroup_root(settings.cgroup_root)
            self.present = self.root is not None and bool(kubecgroups.kubepods_dirs(self.root))
            self._scanned_at, self._unknown = -MIN_RESCAN, set()
            self.scan()

    # -- cgroups --
    def scan(self) -> bool:
        """Look at the kubelet's cgroups now; True when they changed. A pod
        the kubelet's last list lacks wakes the kubelet's poll."""
        if self.root is None:
            return False
        with self._scan_lock:
            began = time.monotonic()
            found = kubecgroups.scan(self.root, self.root_level)
            self._scanned_at = time.monotonic()
            self._settle(found, began)
            self.scans += 1
            self.present = self.present or bool(found)
            changed = found.keys() != self.cgroups.keys()
            if changed:
                self.cgroups, self.pods = found, kubecgroups.pod_cgroups(found)
                self.generation += 1
        k = self.kubelet
        if changed and k is not None and self.wake_kubelet and any(uid not in k.pods for uid in self.pods):
            self.wake_kubelet()
        return changed

    def _settle(self, found: dict, began: float) -> None:
        """The ids looked up by the time a scan began and not found by it
        are no pod's (a process was in the cgroup then: the scan saw it)."""
        with self._pending_lock:
            settled = [c for c, t in self._pending.items() if t <= began]
            for c in settled:
                del self._pending[c]
        for c in settled:
            if c not in found:
                if len(self._unknown) >= MAX_UNKNOWN:
                    self._unknown.clear()
                self._unknown.add(c)

    def cgroup(self, cid: int):
        """The Cgroup of pod or container cgroup cid, or None (scanning once
        more, at most every MIN_RESCAN s, for an id not seen before; the next
        scan that began after its lookup settles it, whichever thread's)."""
        cg = self.cgroups.get(cid)
        if cg is not None or cid in self._unknown or self.root is None:
            return cg
        now = time.monotonic()
        with self._pending_lock:
            if len(self._pending) >= MAX_UNKNOWN:
                self._pending.clear()
            self._pending.setdefault(cid, now)
        if now - self._scanned_at >= MIN_RESCAN:
            self.scan()
        return self.cgroups.get(cid)             # else asked again at the next owner

    def no_pods(self, cid: int) -> bool:
        """Whether cgroup cid is known to be no pod's (a scan begun after
        it was looked up did not find it)."""
        return cid in self._unknown

    def identity(self, cid: int, pid: int = 0, ts_ns: int = 0):
        """The kubepath.Identity of a cgroup id (else, on a node whose pods
        are in cgroup v1 only, of process pid, not started after ts_ns), or
        None."""
        cg = self.cgroup(cid)
        if cg is not None:
            return cg.identity
        if pid and not self.cgroups:         # no pod in cgroup v2 here: a v1 node?
            return self.processes.identity(pid, ts_ns)
        return None

    def pods_gone(self, uids) -> set:
        """Those of uids known to have left the node: in neither the
        kubelet's list (where it answered) nor the last scan of the pods'
        cgroups (where they are here); none without either."""
        k = self.kubelet
        listed = k.pods if k is not None and k.generation else None
        if listed is None and not self.present:
            return set()
        return {u for u in uids if (listed is None or u not in listed) and (not self.present or u not in self.pods)}

    def names(self, ident) -> tuple:
        """(namespace, pod, container) names of an identity, "" where unknown."""
        k = self.kubelet
        pod = k.pods.get(ident.pod_uid) if k is not None else None
        if pod is None:
            return "", "", ""
        return pod.namespace, pod.name, pod.containers.get(ident.container_id, "")

    # -- targets --
    def match(self, sel) -> dict:
        """cgroup id -> level of the cgroups a kubeconfig.Selector names now:
        each matching pod's own cgroup, or with a container name its
        containers of that name (a restarted one's new cgroup included)."""
        k = self.kubelet
        if k is None:
            return {}
        out = {}
        for uid, cgs in self.pods.items():
            pod = k.pods.get(uid)
            if pod is None or not sel.matches(pod.namespace, pod.name, pod.labels):
                continue
            for cid, cg in cgs.items():
                cont = cg.identity.container_id
                if (sel.container is None and not cont) or \
                        (sel.container is not None and cont and pod.containers.get(cont) == sel.container):
                    out[cid] = cg.level
        return out

    def paths(self, cids) -> dict:
        """path -> cgroup id of those of cids known (the targets' processes' walk)."""
        cgs = self.cgroups
        return {cgs[c].path: c for c in cids if c in cgs}

    def close(self) -> None:
        if self.kubelet is not None:
            self.kubelet.close()


class Watch:
    """Two threads: the kubelet's poll, and the cgroups' scan while a
    kubernetes target is in force; on_change() after either saw a change."""

    def __init__(self, node: Node, on_change):
        self.node, self.on_change = node, on_change
        self._stop = threading.Event()
        self._change_lock = threading.Lock()     # held while on_change runs; stop() waits for it
        self._poll_now = threading.Event()
        self._last_wake = -MIN_RESCAN
        node.wake_kubelet = self._wake
        self._threads = [threading.Thread(target=self._kubelet_loop, name="nettap-kubelet", daemon=True),
                         threading.Thread(target=self._cgroups_loop, name="nettap-kube-cgroups", daemon=True)]

    def start(self) -> "Watch":
        for t in self._threads:
            t.start()
        return self

    def _wake(self) -> None:
        self._poll_now.set()

    def _changed(self) -> None:
        with self._change_lock:
            if self._stop.is_set():          # a poll that outlived stop(): the maps may be closed
                return
            try:
                self.on_change()
            except Exception:                # noqa: BLE001 - the watch must outlive one bad round
                log.exception("kubernetes: updating the targets")

    def _kubelet_loop(self) -> None:
        while not self._stop.is_set():
            k, s = self.node.kubelet, self.node.settings
            if k is not None:
                gen, before = k.generation, k.pods
                if k.poll() and (gen == 0 or k.pods != before):
                    self._changed()
            # at most one early poll a second (a pod the list lacks wakes it)
            self._stop.wait(MIN_RESCAN)
            self._poll_now.wait(max(s.poll_seconds - MIN_RESCAN, 0))
            self._poll_now.clear()

    def _cgroups_loop(self) -> None:
        seen = self.node.generation
        while not self._stop.wait(self.node.settings.cgroup_poll_ms / 1000):
            if not self.node.watching:
                continue
            self.node.scan()                 # (a lookup's scan may have seen the change first)
            if self.node.generation != seen:
                seen = self.node.generation
                self._changed()

    def stop(self) -> None:
        """Stop both threads: a poll still waiting on the kubelet after
        STOP_WAIT is left to finish, but no on_change comes after this."""
        self._stop.set()
        self._poll_now.set()
        for t in self._threads:
            if t.is_alive():
                t.join(STOP_WAIT)
        with self._change_lock:              # one under way has finished; none starts now
            pass
        self.node.wake_kubelet = None
