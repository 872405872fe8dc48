#!/usr/bin/env python3
"""nettap's local demo, without Docker: one command, everything real.

    sudo .venv/bin/python scripts/demo.py            # Ctrl-C stops it
    sudo .venv/bin/python scripts/demo.py --duration 60 --rate 50

It starts, as child processes:

- a workload in its own network namespace (made with pyroute2, loopback only):
  Python's http.server on 127.0.0.1:8000 and a load generator
  (deploy/compose/loadgen.py) sending GETs at a fixed rate, one connection each;
- nettap itself (the real CLI from the virtualenv), capturing that namespace
  (``captures: [{netns: /var/run/netns/NAME}]``) to JSON-lines files, on 127.0.0.1:42424;
- a NATS server with JetStream (Debian's nats-server) on 127.0.0.1:4222, and
  ``nettap ingest`` publishing the capture's files to it, on 127.0.0.1:42425;
- Prometheus (Debian's /usr/bin/prometheus) scraping nettap, the ingest and itself every
  5s, loading the mixin's rendered rules from mixin/rendered/, alerting to
- Alertmanager (Debian's /usr/bin/prometheus-alertmanager), clustering off.

Every file it writes (configs, Prometheus' and Alertmanager's storage, NATS' store,
logs, the captured JSON lines) is in one temporary directory. Ports are the usual ones
(42424, 42425, 4222, 9090, 9093) when free, else any free loopback port; ``--*-port 0``
always picks a free one. It prints the URLs, then runs until Ctrl-C, SIGTERM or
``--duration`` seconds, and then stops every child process, removes the network
namespace and the temporary directory. Children also get SIGTERM if the demo
itself is killed (PR_SET_PDEATHSIG).

Needs root (nettap loads eBPF programs; the namespace is created under
/var/run/netns), and Debian's prometheus, prometheus-alertmanager and nats-server
packages (``scripts/setup.sh test`` installs them).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, List, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
NATS_SERVER = "/usr/sbin/nats-server"
LOADGEN = ROOT / "deploy" / "compose" / "loadgen.py"
RULES = (ROOT / "mixin" / "rendered" / "nettap-alerts.yaml", ROOT / "mixin" / "rendered" / "nettap-rules.yaml")
WORKLOAD_PORT = 8000
SCRAPE_INTERVAL = "5s"
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


# ---- generated configs (also checked by tests/unit/test_deploy.py) -----------------------

def nettap_config(netns_path: str, capture_path: str, nats_url: str) -> str:
    doc = {
        "captures": [{"netns": netns_path}],
        "output": {"type": "jsonl", "path": capture_path, "root": os.path.dirname(capture_path),
                   "max_bytes": 16 << 20, "backups": 1},
        "diagnostics": {"bpfStats": {"enabled": False, "scope": "own"}},
        "log_level": "info",
        # nettap ingest's: the capture keeps it unread
        "ingest": {"servers": [nats_url]},
    }
    return ("# nettap's config for the local demo. Edit and save: nettap applies it live\n"
            "# (e.g. diagnostics.bpfStats.enabled: true); nettap ingest reads it at start only.\n"
            + yaml.safe_dump(doc, sort_keys=False))


def prometheus_config(nettap_port: int, ingest_port: int, prometheus_port: int, alertmanager_port: int,
                      rules=RULES) -> str:
    doc = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(r) for r in rules],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": [
            {"job_name": "nettap", "static_configs": [{"targets": [f"127.0.0.1:{nettap_port}"]}]},
            # the mixin's nettapIngestSelector: never the capture's job
            {"job_name": "nettap-ingest", "static_configs": [{"targets": [f"127.0.0.1:{ingest_port}"]}]},
            {"job_name": "alertmanager", "static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]},
            {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{prometheus_port}"]}]},
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


def alertmanager_config() -> str:
    doc = {
        "route": {"receiver": "demo", "group_by": ["alertname", "instance"],
                  "group_wait": "10s", "group_interval": "1m", "repeat_interval": "1h"},
        # Alerts show in Alertmanager's UI; nothing is sent anywhere.
        "receivers": [{"name": "demo"}],
    }
    return yaml.safe_dump(doc, sort_keys=False)


# ---- small helpers ------------------------------------------------------------------------

def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_port(requested: Optional[int], preferred: int, what: str) -> int:
    """requested None: preferred if free, else any free port; 0: any free port."""
    if requested == 0:
        return free_port()
    if requested is not None:
        if not port_free(requested):
            raise SystemExit(f"demo: port {requested} for {what} is in use")
        return requested
    if port_free(preferred):
        return preferred
    port = free_port()
    print(f"demo: port {preferred} is in use, {what} gets {port}", flush=True)
    return port


def tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Stopped(Exception):
    """A signal arrived while the demo was starting."""


class Child:
    """A child process in its own session (so a terminal's Ctrl-C reaches only the
    demo, which then stops children in order), killed with the demo if the demo
    dies, optionally inside a network namespace."""

    def __init__(self, name: str, argv: List[str], log: Optional[Path], netns_fd: Optional[int] = None):
        self.name, self.argv, self.log = name, argv, log
        parent = os.getpid()

        def preexec() -> None:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:          # the demo died before prctl
                os._exit(1)
            if netns_fd is not None and _libc.setns(netns_fd, CLONE_NEWNET) != 0:
                os._exit(1)

        out = open(log, "ab") if log else None
        try:
            # preexec runs before the child closes inherited fds, so netns_fd is still open.
            self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      start_new_session=True, preexec_fn=preexec)
        finally:
            if out:
                out.close()

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 15) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# ---- the demo -----------------------------------------------------------------------------

class Demo:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.children: List[Child] = []
        self.netns: Optional[str] = None
        self.netns_fd: Optional[int] = None
        self.tmp: Optional[Path] = None
        self.stopping = False
        self.reason = ""

    def _stop(self, signum, _frame) -> None:
        self.stopping = True
        self.reason = signal.Signals(signum).name

    def start(self, name: str, argv: List[str], log: bool = True, in_netns: bool = False) -> Child:
        assert self.tmp is not None
        c = Child(name, argv, self.tmp / f"{name}.log" if log else None,
                  self.netns_fd if in_netns else None)
        self.children.append(c)
        return c

    def wait_until(self, what: str, ok: Callable[[], bool], child: Child, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while True:
            if self.stopping:
                raise Stopped()
            if ok():
                return
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with status {child.p.returncode} while {what}"
                                   + (f"; its log ends:\n{child.tail()}" if child.tail() else ""))
            if time.monotonic() > end:
                raise RuntimeError(f"{child.name}: not {what} after {timeout:.0f}s"
                                   + (f"; its log ends:\n{child.tail()}" if child.tail() else ""))
            time.sleep(0.2)

    def make_netns(self, name: str) -> None:
        try:
            from pyroute2 import NetNS, netns
        except ImportError:
            raise RuntimeError("pyroute2 is missing: run scripts/setup.sh test (it installs the test "
                               "extras into .venv), then sudo .venv/bin/python scripts/demo.py") from None
        if name in netns.listnetns():
            raise RuntimeError(f"network namespace {name} exists already (a demo that did not finish?); "
                               f"remove it with: ip netns del {name}")
        netns.create(name)
        self.netns = name
        self.netns_fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        with NetNS(name, flags=0) as ns:
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    def run(self) -> int:
        a = self.args
        nettap_port = choose_port(a.nettap_port, 42424, "nettap")
        ingest_port = choose_port(a.ingest_port, 42425, "nettap ingest")
        nats_port = choose_port(a.nats_port, 4222, "NATS")
        prom_port = choose_port(a.prometheus_port, 9090, "Prometheus")
        am_port = choose_port(a.alertmanager_port, 9093, "Alertmanager")

        self.tmp = Path(tempfile.mkdtemp(prefix="nettap-demo-"))
        os.chmod(self.tmp, 0o755)
        print(f"demo: working directory {self.tmp}", flush=True)

        # The workload, in its own network namespace.
        self.make_netns(a.netns)
        www = self.tmp / "www"
        www.mkdir()
        (www / "index.html").write_text("<!doctype html><title>nettap demo</title>"
                                        "<p>Hello from the nettap demo workload.\n")
        web = self.start("web", [sys.executable, "-m", "http.server", str(WORKLOAD_PORT),
                                 "--bind", "127.0.0.1", "--directory", str(www)], in_netns=True)
        self.wait_until("serving", lambda: _in_netns_connect(self.netns_fd, WORKLOAD_PORT), web, 15)
        self.start("loadgen", [sys.executable, str(LOADGEN), "--url", f"http://127.0.0.1:{WORKLOAD_PORT}/",
                               "--rate", str(a.rate), "--report", "10"], in_netns=True)

        # nettap, capturing that namespace. Its log goes to the terminal: it is the subject.
        nats_url = f"nats://127.0.0.1:{nats_port}"
        cfg = self.tmp / "nettap.yaml"
        cfg.write_text(nettap_config(f"/var/run/netns/{a.netns}", str(self.tmp / "capture.jsonl"), nats_url))
        nettap_bin = Path(sys.executable).parent / "nettap"
        nettap_argv = [str(nettap_bin)] if nettap_bin.exists() else [sys.executable, "-m", "exporter"]
        nettap = self.start("nettap", nettap_argv + ["--config", str(cfg),
                                                     "--web.listen-address", f"127.0.0.1:{nettap_port}"],
                            log=False)

        # The engine (one JetStream server, its store in the working directory) and nettap
        # ingest, publishing the capture's files to it.
        nats = self.start("nats", [NATS_SERVER, "-a", "127.0.0.1", "-p", str(nats_port), "-js",
                                   "-sd", str(self.tmp / "nats"), "-n", "nettap-demo"])
        self.wait_until("listening", lambda: tcp_open(nats_port), nats, 15)
        ingest = self.start("ingest", nettap_argv + ["ingest", "--config", str(cfg),
                                                     "--web.listen-address", f"127.0.0.1:{ingest_port}"])

        # Alertmanager and Prometheus.
        (self.tmp / "alertmanager.yml").write_text(alertmanager_config())
        am = self.start("alertmanager", [ALERTMANAGER, f"--config.file={self.tmp / 'alertmanager.yml'}",
                                         f"--storage.path={self.tmp / 'alertmanager-data'}",
                                         f"--web.listen-address=127.0.0.1:{am_port}",
                                         "--cluster.listen-address="])
        (self.tmp / "prometheus.yml").write_text(prometheus_config(nettap_port, ingest_port, prom_port, am_port))
        prom = self.start("prometheus", [PROMETHEUS, f"--config.file={self.tmp / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={self.tmp / 'prometheus-data'}",
                                         f"--web.listen-address=127.0.0.1:{prom_port}",
                                         "--web.enable-lifecycle"])

        self.wait_until("ready", lambda: http_ok(f"http://127.0.0.1:{nettap_port}/readyz"), nettap)
        self.wait_until("ready (connected to NATS)", lambda: http_ok(f"http://127.0.0.1:{ingest_port}/readyz"),
                        ingest)
        self.wait_until("ready", lambda: http_ok(f"http://127.0.0.1:{am_port}/-/ready"), am)
        self.wait_until("ready", lambda: http_ok(f"http://127.0.0.1:{prom_port}/-/ready"), prom)

        # Debian's Prometheus 2.42 is built without the React UI: it serves the
        # classic one under /classic/ and 404s /alerts (and /graph drops the query
        # on its redirect). Ask it which one it has rather than assume.
        prom_ui = f"http://127.0.0.1:{prom_port}"
        if not http_ok(f"{prom_ui}/alerts") and http_ok(f"{prom_ui}/classic/alerts"):
            prom_ui += "/classic"
        query = "sum by (probe) (rate(nettap_probe_calls_total[1m]))"
        graph = (f"{prom_ui}/graph?" +
                 urllib.parse.urlencode({"g0.expr": query, "g0.tab": "0", "g0.range_input": "15m"}))
        print(f"""
nettap demo is running.
  nettap        http://127.0.0.1:{nettap_port}/metrics   (also /stats /healthz /readyz)
  ingest        http://127.0.0.1:{ingest_port}/metrics   (nettap ingest, the captures to NATS; also /stats /readyz)
  NATS          {nats_url:<32} JetStream, stream NETTAP
  stream        {" ".join(nettap_argv)} read --nats {nats_url}   (the connections it holds)
  Prometheus    http://127.0.0.1:{prom_port}            alerts: {prom_ui}/alerts
  Alertmanager  http://127.0.0.1:{am_port}
  workload      network namespace {a.netns}: http.server on 127.0.0.1:{WORKLOAD_PORT}, {a.rate:g} requests/s
                (ip netns exec {a.netns} curl http://127.0.0.1:{WORKLOAD_PORT}/)
  try           {query}
                {graph}
  config        {cfg}  (edit and save: applied live, e.g. diagnostics.bpfStats.enabled: true)
  captured      {self.tmp / 'capture.jsonl'}
  logs          {self.tmp}/*.log
{"Stops by itself in " + format(a.duration, "g") + "s; " if a.duration else ""}Ctrl-C stops everything.
""", flush=True)

        end = time.monotonic() + a.duration if a.duration else float("inf")
        while not self.stopping:
            for c in self.children:
                if not c.alive():
                    raise RuntimeError(f"{c.name} exited with status {c.p.returncode}"
                                       + (f"; its log ends:\n{c.tail()}" if c.tail() else ""))
            if time.monotonic() >= end:
                self.reason = f"--duration {a.duration:g}s"
                break
            time.sleep(0.5)
        return 0

    def cleanup(self) -> None:
        """Stop every child (SIGTERM to its process group, SIGKILL after a grace period),
        remove the network namespace and the working directory. Idempotent."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)       # finish cleaning up, whatever arrives
        if self.children:
            print(f"demo: stopping ({self.reason or 'done'})", flush=True)
        for c in reversed(self.children):
            c.signal_group(signal.SIGTERM)
        end = time.monotonic() + self.args.grace
        for c in reversed(self.children):
            try:
                c.p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"demo: {c.name} ignored SIGTERM for {self.args.grace:g}s, killing it", flush=True)
                c.signal_group(signal.SIGKILL)
                c.p.wait()
            c.signal_group(signal.SIGKILL)          # anything it left in its process group
        self.children = []
        if self.netns_fd is not None:
            _kill_netns_processes(self.netns_fd)
            os.close(self.netns_fd)
            self.netns_fd = None
        if self.netns:
            from pyroute2 import netns
            try:
                netns.remove(self.netns)
            except OSError as e:
                print(f"demo: could not remove network namespace {self.netns}: {e}", file=sys.stderr)
            self.netns = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        print("demo: stopped; network namespace and working directory removed", flush=True)


def _in_netns_connect(netns_fd: Optional[int], port: int) -> bool:
    """Can a process in the namespace connect to 127.0.0.1:port? (A short-lived child
    does the connect, so the demo itself never leaves its own namespace.)"""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if _libc.setns(netns_fd, CLONE_NEWNET) == 0:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    code = 0
        except OSError:
            pass
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _kill_netns_processes(netns_fd: int) -> None:
    """SIGKILL any process still in the demo's namespace (none should be)."""
    ino = os.fstat(netns_fd).st_ino
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == ino:
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="nettap's local demo: nettap + nettap ingest + NATS + Prometheus "
                                            "+ Alertmanager + a workload in a network namespace, no Docker.")
    p.add_argument("--duration", type=float, default=0, metavar="SECONDS",
                   help="stop by itself this long after everything is up (default: run until Ctrl-C)")
    p.add_argument("--rate", type=float, default=20, help="workload requests per second (default %(default)s)")
    p.add_argument("--nettap-port", type=int, metavar="PORT", help="default 42424 if free; 0 = any free port")
    p.add_argument("--ingest-port", type=int, metavar="PORT", help="nettap ingest's metrics: default 42425 if free; "
                                                                   "0 = any free port")
    p.add_argument("--nats-port", type=int, metavar="PORT", help="default 4222 if free; 0 = any free port")
    p.add_argument("--prometheus-port", type=int, metavar="PORT", help="default 9090 if free; 0 = any free port")
    p.add_argument("--alertmanager-port", type=int, metavar="PORT", help="default 9093 if free; 0 = any free port")
    p.add_argument("--netns", default="nettap-demo",
                   help="name of the workload's network namespace (default %(default)s)")
    p.add_argument("--grace", type=float, default=10,
                   help="seconds a child gets to exit after SIGTERM (default %(default)s)")
    args = p.parse_args(argv)

    if os.geteuid() != 0:
        print("demo: needs root (nettap loads eBPF programs; the workload gets a network namespace):\n"
              "  sudo .venv/bin/python scripts/demo.py", file=sys.stderr)
        return 1
    missing = [b for b in (PROMETHEUS, ALERTMANAGER, NATS_SERVER) if not os.access(b, os.X_OK)]
    if missing:
        print(f"demo: missing {', '.join(missing)}: apt-get install prometheus prometheus-alertmanager nats-server "
              "(or scripts/setup.sh test)", file=sys.stderr)
        return 1

    demo = Demo(args)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, demo._stop)
    try:
        return demo.run()
    except Stopped:
        return 0
    except RuntimeError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    finally:
        demo.cleanup()


if __name__ == "__main__":
    sys.exit(main())
