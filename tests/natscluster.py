"""A real nats-server (2.9+) JetStream cluster for tests: N nodes on 127.0.0.1,
children of the test process, each with its own free ports, store dir and log
in a temp dir; plus a test CA with server and client certificates (openssl) and
an nkey user (nkeys)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, List, NamedTuple, Optional, Tuple

import requests

from procs import free_port

NATS_SERVER = shutil.which("nats-server")
STOP_GRACE = 5.0            # seconds between SIGTERM and SIGKILL
LOG_TAIL = 3000             # characters of a node's log quoted in an error


@dataclass
class _Node:
    name: str               # server_name: n1..nN, stable across restarts
    client: int             # ports
    route: int
    http: int
    dir: Path               # conf, log and store
    proc: Optional[subprocess.Popen] = None
    log: Optional[IO[bytes]] = None

    @property
    def conf(self) -> Path:
        return self.dir / "nats.conf"

    @property
    def log_path(self) -> Path:
        return self.dir / "nats.log"

    def tail(self) -> str:
        """The end of this node's log, headed by its name and path, for an error message."""
        if self.log:
            self.log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"{self.name}: no log"
        return f"--- {self.name} log ({self.log_path}) ---\n{text[-LOG_TAIL:]}"


def _q(s: str) -> str:
    """A string as a quoted nats.conf value."""
    return json.dumps(str(s))


def _free_ports(n: int) -> List[int]:
    """n distinct free loopback ports (free when asked: a race with other processes remains)."""
    ports: List[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def _auth_conf(auth: Optional[dict]) -> str:
    if not auth:
        return ""
    if set(auth) == {"user", "password"}:
        return f"authorization {{ users: [ {{user: {_q(auth['user'])}, password: {_q(auth['password'])}}} ] }}\n"
    if set(auth) == {"token"}:
        return f"authorization {{ token: {_q(auth['token'])} }}\n"
    if set(auth) == {"nkey"}:
        return f"authorization {{ users: [ {{nkey: {_q(auth['nkey'])}}} ] }}\n"
    raise ValueError(f"auth: one of {{user, password}}, {{token}} or {{nkey}}, not {sorted(auth)}")


def _tls_conf(tls: Optional[dict]) -> str:
    if not tls:
        return ""
    unknown = set(tls) - {"cert_file", "key_file", "ca_file", "verify"}
    if unknown or not {"cert_file", "key_file"} <= set(tls):
        raise ValueError(f"tls: cert_file and key_file, optionally ca_file and verify, not {sorted(tls)}")
    lines = [f"{k}: {_q(tls[k])}" for k in ("cert_file", "key_file", "ca_file") if tls.get(k)]
    lines.append(f"verify: {'true' if tls.get('verify') else 'false'}")
    return "tls {\n  " + "\n  ".join(lines) + "\n}\n"


class NatsCluster:
    """N nats-server nodes with JetStream, node i (0-based) named n{i+1}.

    One node runs standalone (no cluster block: R1 streams only); two or more
    form cluster `name` over routes to each other. `auth` applies to client
    connections (routes are unauthenticated loopback), `tls` to the client port.
    Ports, names and store dirs stay the node's across start_node().
    """

    def __init__(self, tmp: Path, n: int = 3, auth: Optional[dict] = None, tls: Optional[dict] = None,
                 name: str = "nettap-test", extra: str = ""):
        if NATS_SERVER is None:
            raise RuntimeError("nats-server is not on PATH (Debian: apt-get install nats-server)")
        if n < 1:
            raise ValueError("a cluster needs a node")
        self.tmp, self.name, self.tls, self.auth, self.extra = Path(tmp), name, tls, auth, extra
        self.procs: List[subprocess.Popen] = []     # every node process started, in order
        ports = _free_ports(3 * n)
        self.nodes = [_Node(f"n{i + 1}", *ports[3 * i:3 * i + 3], dir=self.tmp / f"n{i + 1}") for i in range(n)]
        for node in self.nodes:
            node.dir.mkdir(parents=True, exist_ok=True)
        self.configure(tls=tls, extra=extra)

    def configure(self, tls: Optional[dict] = None, extra: str = "") -> None:
        """(Re)write every node's config: `tls` for the client port, `extra`
        appended as it is (e.g. "max_payload: 65536"); a running node
        reads it at its next start."""
        self.tls, self.extra = tls, extra
        common = _auth_conf(self.auth) + _tls_conf(tls) + (extra + "\n" if extra else "")
        for node in self.nodes:
            node.conf.write_text(self._conf(node) + common)

    def _conf(self, node: _Node) -> str:
        conf = (f"server_name: {node.name}\nhost: 127.0.0.1\nport: {node.client}\n"
                f"http: \"127.0.0.1:{node.http}\"\n"
                f"jetstream {{ store_dir: {_q(node.dir / 'store')}, max_memory_store: 256MB, max_file_store: 2GB }}\n")
        if len(self.nodes) > 1:
            routes = ", ".join(f'"nats-route://127.0.0.1:{m.route}"' for m in self.nodes if m is not node)
            conf += (f"cluster {{\n  name: {_q(self.name)}\n  listen: \"127.0.0.1:{node.route}\"\n"
                     f"  routes: [{routes}]\n}}\n")
        return conf

    # -- addresses

    @property
    def urls(self) -> List[str]:
        """Every node's client URL (tls:// when the cluster has tls), node order."""
        scheme = "tls" if self.tls else "nats"
        return [f"{scheme}://127.0.0.1:{node.client}" for node in self.nodes]

    def monitor(self, i: int) -> str:
        """Node i's monitoring base URL (plain http)."""
        return f"http://127.0.0.1:{self.nodes[i].http}"

    def log(self, i: int) -> str:
        """Node i's log so far (every start of it appends)."""
        node = self.nodes[i]
        if node.log:
            node.log.flush()
        return node.log_path.read_text(errors="replace") if node.log_path.exists() else ""

    def running(self, i: int) -> bool:
        """Was node i started and not stopped or killed since (it may have died)?"""
        return self.nodes[i].proc is not None

    # -- lifecycle

    def start(self) -> "NatsCluster":
        """Start every node not running, then wait_healthy() on all of them
        and for the full mesh of routes (healthy needs a meta leader only: two
        of three nodes routed suffice)."""
        for i, node in enumerate(self.nodes):
            if node.proc is None:
                self._spawn(i)
        self.wait_healthy()
        self.wait_routed()
        return self

    def wait_routed(self, timeout: float = 30) -> None:
        """Wait until every running node has a route to each other running node."""
        nodes = [j for j in range(len(self.nodes)) if self.nodes[j].proc is not None]
        if len(nodes) < 2:
            return

        def routed():
            ok = all(self._get(j, "/routez").json().get("num_routes", 0) >= len(nodes) - 1 for j in nodes)
            return True if ok else None
        names = ", ".join(self.nodes[j].name for j in nodes)
        self._wait(nodes, routed, timeout, f"a route between every two of {names}")

    def start_node(self, i: int, timeout: float = 60) -> None:
        """Start node i again (same ports, name and store) and wait for its /healthz."""
        if self.nodes[i].proc is not None:
            raise RuntimeError(f"{self.nodes[i].name} is already running")
        self._spawn(i)
        self.wait_healthy(i, timeout)

    def _spawn(self, i: int) -> None:
        node = self.nodes[i]
        node.log = open(node.log_path, "ab")
        try:
            node.proc = subprocess.Popen([NATS_SERVER, "-c", str(node.conf)], stdin=subprocess.DEVNULL,
                                         stdout=node.log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError:
            self._forget(node)
            raise
        self.procs.append(node.proc)
        atexit.unregister(self.close)               # once: close() stops whatever a test left running
        atexit.register(self.close)

    def kill(self, i: int, sig: int = signal.SIGKILL, timeout: float = 10) -> int:
        """Send sig to node i and reap it; its exit status (-sig when killed by it)."""
        node = self.nodes[i]
        if node.proc is None:
            raise RuntimeError(f"{node.name} is not running")
        if node.proc.poll() is None:
            node.proc.send_signal(sig)
        try:
            rc = node.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{node.name} still running {timeout} s after signal {sig}\n{node.tail()}") from None
        self._forget(node)
        return rc

    def stop(self, i: int) -> int:
        """SIGTERM node i (a graceful JetStream shutdown), SIGKILL after STOP_GRACE s; its exit status."""
        try:
            return self.kill(i, signal.SIGTERM, STOP_GRACE)
        except TimeoutError:
            return self.kill(i, signal.SIGKILL)

    @staticmethod
    def _forget(node: _Node) -> None:
        node.proc = None
        if node.log:
            node.log.close()
            node.log = None

    def close(self) -> None:
        """Stop every node (SIGTERM to all at once, SIGKILL after STOP_GRACE s) and reap it."""
        live = [n for n in self.nodes if n.proc is not None]
        for node in live:
            if node.proc.poll() is None:
                node.proc.terminate()
        end = time.monotonic() + STOP_GRACE
        for node in live:
            try:
                node.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
            self._forget(node)
        atexit.unregister(self.close)

    def __enter__(self) -> "NatsCluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # -- monitoring

    def _get(self, i: int, path: str) -> requests.Response:
        return requests.get(self.monitor(i) + path, timeout=2)

    def _wait(self, nodes: List[int], pred: Callable[[], object], timeout: float, what: str):
        """pred()'s first value that is not None, polled every 50 ms; a node in
        `nodes` that exits fails at once, a timeout fails with their log tails."""
        end = time.monotonic() + timeout
        last: object = None
        while True:
            for i in nodes:
                node = self.nodes[i]
                if node.proc is None:
                    raise RuntimeError(f"{node.name} is not running")
                if node.proc.poll() is not None:
                    raise RuntimeError(f"{node.name} exited with {node.proc.returncode} waiting for {what}\n"
                                       + node.tail())
            try:
                last = pred()
                if last is not None:
                    return last
            except (requests.RequestException, ValueError, KeyError) as e:
                last = e
            if time.monotonic() >= end:
                tails = "\n".join(self.nodes[i].tail() for i in nodes)
                raise TimeoutError(f"timed out after {timeout} s waiting for {what} (last: {last!r})\n{tails}")
            time.sleep(0.05)

    def wait_healthy(self, i: Optional[int] = None, timeout: float = 60) -> None:
        """Wait until GET /healthz is 200 on node i, or on every running node.

        In 2.9 that means: a meta leader is known and every stream the node
        holds is current (?js-enabled-only=true is 200 long before either).
        """
        nodes = [i] if i is not None else [j for j in range(len(self.nodes)) if self.nodes[j].proc is not None]
        todo = set(nodes)

        def healthy():
            for j in sorted(todo):
                if self._get(j, "/healthz").status_code == 200:
                    todo.discard(j)
            return None if todo else True
        self._wait(nodes, healthy, timeout, f"/healthz 200 on {', '.join(self.nodes[j].name for j in nodes)}")

    def stream_leader(self, stream: str, account: str = "$G", timeout: float = 30) -> int:
        """The node that leads `stream` now, as its own /jsz says (a node that
        calls itself the leader); waits out an election, up to timeout s."""
        live = [j for j in range(len(self.nodes)) if self.nodes[j].proc is not None]

        def leader():
            for j in live:
                for acc in self._get(j, "/jsz?accounts=true&streams=true").json().get("account_details") or []:
                    if acc.get("name") != account:
                        continue
                    for st in acc.get("stream_detail") or []:
                        if st.get("name") != stream:
                            continue
                        cl = st.get("cluster") or {}
                        if len(self.nodes) == 1 or cl.get("leader") == self.nodes[j].name:
                            return j
            return None
        return self._wait(live, leader, timeout, f"a leader of stream {stream}")


# -- credentials


class TlsFiles(NamedTuple):
    """A test CA and the server and client certificates it signed (PEM files)."""
    ca_file: Path
    cert_file: Path         # server: SAN DNS:localhost, IP:127.0.0.1
    key_file: Path
    client_cert_file: Path
    client_key_file: Path

    def server(self, verify: bool = False) -> dict:
        """NatsCluster's tls option; verify=True requires client certificates."""
        return {"cert_file": self.cert_file, "key_file": self.key_file, "ca_file": self.ca_file, "verify": verify}

    def client_context(self, cert: bool = True) -> ssl.SSLContext:
        """A client context trusting the CA, presenting the client certificate if cert."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if cert:
            ctx.load_cert_chain(str(self.client_cert_file), str(self.client_key_file))
        return ctx


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr.strip()}")


def make_tls(d: Path) -> TlsFiles:
    """Write a P-256 CA (ca.pem), a server cert for localhost and 127.0.0.1
    (server.pem/.key) and a client cert (client.pem/.key) into d, valid 2 days."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=nettap test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for who, ext in (("server", "serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "clientAuth")):
        (d / f"{who}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                      "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
                                      f"extendedKeyUsage={ext}\n")
        _openssl("req", "-new", *key, "-keyout", f"{who}.key", "-out", f"{who}.csr",
                 "-subj", f"/CN={'localhost' if who == 'server' else 'nettap test client'}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial",
                 str(int.from_bytes(os.urandom(8), "big")), "-days", "2", "-extfile", f"{who}.ext",
                 "-out", f"{who}.pem", cwd=d)
    return TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


def make_nkey(d: Path, name: str = "user") -> Tuple[Path, str]:
    """A new nkey user: (its seed file d/<name>.nk, mode 0600; its public key "U...")."""
    import nkeys
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = Path(d) / f"{name}.nk"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    return path, nkeys.from_seed(seed).public_key.decode()
