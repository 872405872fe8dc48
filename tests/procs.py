"""Real processes for end-to-end tests: nettap (the real CLI), Prometheus
and Alertmanager (Debian's packages), each on a free loopback port, with
their state in a temp dir, stopped at teardown."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], object], timeout: float = 60, step: float = 0.1, what: str = "condition"):
    """pred()'s first true value, polled from every 10 ms (most conditions
    hold within a few) backing off to every `step` s; TimeoutError after timeout."""
    end = time.time() + timeout
    last, pause = None, min(0.01, step)
    while time.time() < end:
        try:
            last = pred()
            if last:
                return last
        except (requests.RequestException, OSError, KeyError, ValueError) as e:
            last = e
        time.sleep(pause)
        pause = min(pause * 1.5, step)
    raise TimeoutError(f"timed out waiting for {what} (last: {last!r})")


def _join(cgroups) -> None:
    for d in cgroups:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


READY_TIMEOUT = 180


class Child:
    """A process a test started (p) and its log file (log)."""
    p: subprocess.Popen

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send sig if it still runs, close its log; its exit status
        (TimeoutExpired after 30 s: a hang fails the test, it is not killed)."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
        rc = self.p.wait(30)
        self.log.close()
        return rc

    def _serve(self, d: Path, binary: str, config_name: str, cfg: dict, *flags: str) -> None:
        """Start a Prometheus-style binary (--config.file, --web.listen-address
        on self.port) with cfg written to d/config_name; its log is d/log."""
        d.mkdir()
        (d / config_name).write_text(yaml.safe_dump(cfg))
        self.log = open(d / "log", "ab")
        self.p = subprocess.Popen([binary, f"--config.file={d}/{config_name}",
                                   f"--web.listen-address=127.0.0.1:{self.port}", *flags],
                                  stdout=self.log, stderr=subprocess.STDOUT)


class Nettap(Child):
    def __init__(self, tmp: Path, cfg: Optional[dict], config_path: Optional[Path] = None,
                 cgroups: List[str] = (), wrap: List[str] = (), env: Optional[dict] = None,
                 args: List[str] = ()):
        """Start on cfg written to tmp/nettap.yaml, or on an existing config_path;
        inside the given cgroup directories (their cgroup.procs), if any; run
        through the command wrap (e.g. unshare, setpriv), if given; with
        the extra command-line args, if given."""
        self.port = free_port()
        self.cfg_path = config_path or tmp / "nettap.yaml"
        if cfg is not None:
            self.write_config(cfg)
        self.log = open(tmp / "nettap.log", "ab")
        self.p = subprocess.Popen([*wrap, sys.executable, "-m", "exporter", "--config", str(self.cfg_path),
                                   "--web.listen-address", f"127.0.0.1:{self.port}", *args],
                                  cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                  preexec_fn=(lambda: _join(cgroups)) if cgroups else None)
        self.url = f"http://127.0.0.1:{self.port}"

        def ready():
            if self.p.poll() is not None:           # exited: no point waiting
                self.log.flush()
                raise AssertionError(f"nettap exited with {self.p.returncode} before it was ready: "
                                     + (tmp / "nettap.log").read_text(errors="replace")[-2000:])
            return requests.get(self.url + "/readyz", timeout=1).status_code == 200
        # Ready takes ~0.3 s here and up to a minute in the kernel matrix's
        # emulated guests (imports and program loads run ~10-50x slower).
        try:
            wait_for(ready, timeout=READY_TIMEOUT, what="nettap ready")
        except TimeoutError as e:                   # say where it was
            self.log.flush()
            raise TimeoutError(f"{e}; its log: " + (tmp / "nettap.log").read_text(errors="replace")[-3000:]) from None

    def write_config(self, cfg: dict) -> None:
        tmp = self.cfg_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        os.replace(tmp, self.cfg_path)

    def metrics_text(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text

    def sample(self, name: str, **labels) -> Optional[float]:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        prefix = f"{name}{{{want}}} " if labels else f"{name} "
        for line in self.metrics_text().splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
        return None


class Ingest(Child):
    """`nettap ingest` as a child process, with its metrics."""

    def __init__(self, tmp: Path, cfg: dict, name: str = "ingest"):
        self.cfg_path = tmp / f"{name}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.log_path = tmp / f"{name}.log"
        self.port = free_port()
        self.start()

    def start(self):
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", "exporter", "ingest", "--config", str(self.cfg_path),
                                   "--web.listen-address", f"127.0.0.1:{self.port}"],
                                  cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: self._up(), timeout=30, what="ingest serving")

    def _up(self):
        assert self.p.poll() is None, self.text()
        try:
            return requests.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).ok
        except requests.ConnectionError:
            return False

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict:
        out = {}
        for line in requests.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text.splitlines():
            if line.startswith("nettap_ingest_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


class Prometheus(Child):
    def __init__(self, tmp: Path, scrape: Dict[str, str], rule_files: List[str] = (),
                 alertmanager: Optional[str] = None, interval: str = "1s", eval_interval: str = "1s"):
        self.port = free_port()
        d = tmp / f"prom-{self.port}"
        cfg = {"global": {"scrape_interval": interval, "evaluation_interval": eval_interval},
               "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                  for job, target in scrape.items()],
               "rule_files": [str(f) for f in rule_files]}
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self._serve(d, "/usr/bin/prometheus", "prometheus.yml", cfg, f"--storage.tsdb.path={d}/data",
                    "--web.enable-lifecycle")
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(lambda: requests.get(self.url + "/-/ready", timeout=1).status_code == 200, what="prometheus ready")
        # The scrape manager applies new targets on a 5 s tick: wait for the first scrapes.
        wait_for(lambda: len(self.query("up == 1")) == len(scrape), timeout=30, what="targets up")

    def query(self, expr: str) -> list:
        r = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        if r["status"] != "success":
            raise AssertionError(f"query {expr!r} failed: {r}")
        return r["data"]["result"]


class Alertmanager(Child):
    def __init__(self, tmp: Path, webhook: str):
        self.port = free_port()
        d = tmp / f"am-{self.port}"
        cfg = {"route": {"receiver": "test", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
               "receivers": [{"name": "test", "webhook_configs": [{"url": webhook, "send_resolved": False}]}]}
        self._serve(d, "/usr/bin/prometheus-alertmanager", "am.yml", cfg, f"--storage.path={d}/data",
                    "--cluster.listen-address=")
        self.addr = f"127.0.0.1:{self.port}"
        wait_for(lambda: requests.get(f"http://{self.addr}/-/ready", timeout=1).status_code == 200,
                 what="alertmanager ready")


def held_programs(pid: int) -> set:
    """Ids of the BPF programs process pid holds (from its fdinfo)."""
    from exporter.kernel import fdinfo
    return {fdinfo.read_prog_fdinfo(path).prog_id for _, _, path in fdinfo.iter_bpf_fds("/proc", pid)}


def loaded_programs() -> set:
    """Ids of every BPF program loaded in the kernel."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"] for p in json.loads(out or "[]")}


def stats_held_elsewhere(exclude=()) -> bool:
    """Does any process (but those excluded) hold a BPF_ENABLE_STATS fd, or
    the sysctl say on? The kernel's own answer, found the slow way."""
    with open("/proc/sys/kernel/bpf_stats_enabled") as f:
        if f.read().strip() == "1":
            return True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in exclude:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:bpf-stats":
                    return True
            except OSError:
                pass
    return False
