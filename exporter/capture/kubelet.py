"""The node's pods, as its kubelet lists them: names, labels and containers.

The kubelet serves ``GET /pods`` on its authenticated port (10250) as a v1
PodList (the API's own document: ``items[].metadata.{namespace, name, uid,
labels}``, ``items[].status.containerStatuses[].{name, containerID}``); a
DaemonSet's service account token is accepted where RBAC grants
``nodes/proxy`` (or ``nodes/pods`` on newer clusters) get. :class:`Kubelet`
asks it, bounded (a whole answer within the timeout, at most max_bytes),
counts each poll by its result and keeps the last good list when one fails.
"""
from __future__ import annotations

import json
import logging
import time
from collections import namedtuple

from exporter.util.httpget import FetchError, get, shown
from exporter.util.kubeconfig import pod_names_valid

log = logging.getLogger(__name__)

RESULTS = ("ok", "timeout", "unreachable", "http", "too_large", "malformed", "token", "error")
ERROR_LOG_EVERY = 60.0      # s between two logs of an unexpected failure (a traceback), not one each poll
# containerStatuses[].containerID: <runtime>://<id>
_STATUSES = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")


class Pod(namedtuple("Pod", "namespace name uid labels containers")):
    """labels: {key: value}; containers: {container id (hex): its name}."""

    __slots__ = ()


class Malformed(ValueError):
    pass


def _str(v, what: str) -> str:
    if not isinstance(v, str):
        raise Malformed(f"{what} is not a string")
    return v


def _list(v, what: str) -> list:
    if v is None:
        return []
    if not isinstance(v, list):
        raise Malformed(f"{what} is not a list")
    return v


def pod_list(body: bytes, skipped: list | None = None) -> dict:
    """A PodList document's pods by UID (Malformed: not one). A container
    not started yet (no containerID) is left out of its pod's containers. A
    pod whose namespace, name, labels or containers' names the API server
    would not admit is left out, its reason appended to skipped: the names go
    into lines and label values, where a lone surrogate fails a whole batch."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"not JSON: {shown(str(e))}") from None
    if not isinstance(doc, dict) or doc.get("kind", "PodList") != "PodList" or not isinstance(doc.get("items"), list):
        raise Malformed("not a PodList (no items list)")
    pods = {}
    for i, item in enumerate(doc["items"]):
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise Malformed(f"items[{i}] has no metadata")
        labels = meta.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise Malformed(f"items[{i}].metadata.labels is not a mapping of strings")
        status = item.get("status") or {}
        if not isinstance(status, dict):
            raise Malformed(f"items[{i}].status is not a mapping")
        containers = {}
        for key in _STATUSES:
            for c in _list(status.get(key), f"items[{i}].status.{key}"):
                cid = c.get("containerID") if isinstance(c, dict) else None
                if isinstance(cid, str) and "://" in cid:
                    containers[cid.split("://", 1)[1]] = _str(c.get("name"), f"items[{i}] container name")
        uid = _str(meta.get("uid"), f"items[{i}].metadata.uid")
        pod = Pod(_str(meta.get("namespace"), f"items[{i}].metadata.namespace"),
                  _str(meta.get("name"), f"items[{i}].metadata.name"), uid, dict(labels), containers)
        if not pod_names_valid(pod.namespace, pod.name, labels, containers.values()):
            if skipped is not None:
                skipped.append(f"items[{i}] {shown(ascii(f'{pod.namespace}/{pod.name}'), 130)}: a name, label "
                               "or container name the API server would not admit")
            continue
        pods[uid] = pod
    return pods


class Kubelet:
    """One kubelet's pod list. poll() from one thread; pods (a dict
    replaced whole, never changed in place), results and last_success are
    read from any."""

    def __init__(self, url: str, token_file: str | None, ca_file: str | None, insecure: bool = False,
                 timeout: float = 5.0, max_bytes: int = 8 << 20):
        self.url, self.token_file, self.timeout, self.max_bytes = url, token_file, timeout, max_bytes
        self.ca_file, self.insecure = ca_file, insecure
        self.pods: dict = {}
        self.generation = 0                  # one more at each list taken
        self.results = dict.fromkeys(RESULTS, 0)
        self.last_success = 0.0
        self.last_error = ""
        self._session = None
        self._error_logged = -ERROR_LOG_EVERY
        self._skip_logged = -ERROR_LOG_EVERY
        self.skipped = 0                     # pods of the last list left out (pod_list)

    def _token(self) -> str | None:
        if not self.token_file:
            return None
        with open(self.token_file) as f:     # re-read each time: projected tokens rotate
            return f.read(1 << 16).strip()

    def poll(self) -> bool:
        """Ask the kubelet once; True when its list was taken. Never raises:
        an unexpected failure (a bug) is counted as "error", its traceback
        logged at most every ERROR_LOG_EVERY s, and the next poll made."""
        try:
            return self._poll()
        except Exception as e:               # noqa: BLE001 - the poller must outlive one bad answer
            self.results["error"] += 1
            now = time.monotonic()
            if now - self._error_logged >= ERROR_LOG_EVERY:
                self._error_logged = now
                log.error("kubernetes: kubelet poll failed (error), keeping its last list (%d pods): %s",
                          len(self.pods), shown(repr(e)), exc_info=True)
            return False

    def _poll(self) -> bool:
        import requests
        if self._session is None:
            self._session = requests.Session()
            self._session.verify = False if self.insecure else (self.ca_file or True)
            self._session.trust_env = False          # never through a proxy from the environment
        try:
            token = self._token()
        except OSError as e:
            return self._failed("token", f"cannot read the token {self.token_file}: {e.strerror}")
        self._session.headers["Authorization"] = f"Bearer {token}" if token else ""
        skipped: list = []
        try:
            pods = pod_list(get(self.url, deadline=self.timeout, max_bytes=self.max_bytes, session=self._session),
                            skipped)
        except FetchError as e:
            return self._failed(e.reason, str(e))
        except Malformed as e:
            return self._failed("malformed", f"{self.url}: {e}")
        self.pods, self.skipped = pods, len(skipped)
        if skipped and time.monotonic() - self._skip_logged >= ERROR_LOG_EVERY:
            self._skip_logged = time.monotonic()
            log.warning("kubernetes: %d pods of the kubelet's list left out, e.g. %s", len(skipped), skipped[0])
        self.generation += 1
        self.results["ok"] += 1
        self.last_success = time.time()
        if self.last_error:
            log.info("kubernetes: the kubelet answers again (%d pods)", len(pods))
        self.last_error = ""
        return True

    def _failed(self, reason: str, why: str) -> bool:
        self.results[reason] += 1
        if why != self.last_error:           # once per kind of failure, not at every poll
            log.warning("kubernetes: kubelet poll failed (%s), %s: %s", reason,
                        f"keeping its last list ({len(self.pods)} pods)" if self.generation
                        else "pods are known by their UIDs only", why)
        self.last_error = why
        return False

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
