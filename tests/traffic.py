"""Real TCP traffic for the kernel and end-to-end tests: loopback servers
that read until EOF, and clients that send N messages of S bytes with one
send call each."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

# The payload used everywhere: every byte value, so non-UTF-8 bytes and NULs
# are exercised, in an order that is not a repetition of the message size.
def payload(n: int, seed: int = 7) -> bytes:
    return bytes(((i * 131 + seed) ^ (i >> 3)) & 0xFF for i in range(n))


def in_netns(name: str, fn):
    """fn() in a thread moved into network namespace name (setns applies to
    the calling thread only; sockets keep the namespace they were made in)."""
    from pyroute2 import netns
    out, err = [], []

    def run():
        try:
            netns.setns(name, flags=0)
            out.append(fn())
        except BaseException as e:       # noqa: BLE001 - re-raised in the caller
            err.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if err:
        raise err[0]
    return out[0]


def listener(port: int, rcvbuf: int = 0, backlog: int = 8) -> socket.socket:
    """A socket listening on 127.0.0.1:port (SO_REUSEADDR); rcvbuf, when
    given, is its receive buffer, which the sockets it accepts inherit (a
    small window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind(("127.0.0.1", port))
    s.listen(backlog)
    return s


class Server:
    """Accepts connections on 127.0.0.1:port and reads each to EOF."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", family: int = socket.AF_INET):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.received: List[bytes] = []
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(c,), daemon=True).start()

    def _read(self, c: socket.socket) -> None:
        buf = []
        with c:
            while True:
                d = c.recv(65536)
                if not d:
                    break
                buf.append(d)
        with self._lock:
            self.received.append(b"".join(buf))

    def wait_received(self, count: int, timeout: float = 10) -> None:
        end = time.time() + timeout
        while time.time() < end:
            with self._lock:
                if len(self.received) >= count:
                    return
            time.sleep(0.01)
        raise TimeoutError(f"server got {len(self.received)} of {count} connections")

    def close(self) -> None:
        # shutdown wakes the thread blocked in accept(), which otherwise keeps
        # the listening socket (and its port) alive after close.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def send_messages(port: int, n: int, size: int, host: str = "127.0.0.1", data: Optional[bytes] = None) -> bytes:
    """Connect, send n messages of size bytes, one send() call each, close.
    Returns everything sent."""
    data = data or payload(n * size)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect((host, port))
        for i in range(n):
            sent = s.send(data[i * size:(i + 1) * size])
            assert sent == size, f"short send: {sent} of {size}"
    return data


CLIENT_SCRIPT = r"""
import sys, socket
sys.path.insert(0, {tests!r})
from traffic import send_messages
port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()                      # wait for 'go'
send_messages(port, n, size)
sys.stdout.write("done\n"); sys.stdout.flush()
"""


class ClientProcess:
    """A client in its own process (for pid and cgroup targets): it starts,
    says ready, and sends only once go() is called."""

    def __init__(self, port: int, n: int, size: int, prefix: Optional[List[str]] = None):
        tests = os.path.dirname(os.path.abspath(__file__))
        self.p = subprocess.Popen((prefix or []) + [sys.executable, "-c", CLIENT_SCRIPT.format(tests=tests),
                                                    str(port), str(n), str(size)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"
        self.pid = self.p.pid

    def go(self, timeout: float = 20) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"
        self.p.wait(timeout)


def requests(lst: socket.socket, n: int, size: int) -> list:
    """n connections to lst, one after another: a request of size bytes, an
    answer as long, the client closes first, then the server. Returns each
    connection's client port."""
    port, ports = lst.getsockname()[1], []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port))
        a, _ = lst.accept()
        c.sendall(b"q" * size)
        assert a.recv(size, socket.MSG_WAITALL) == b"q" * size
        a.sendall(b"a" * size)
        assert c.recv(size, socket.MSG_WAITALL) == b"a" * size
        ports.append(c.getsockname()[1])
        c.close()
        assert a.recv(1) == b""
        a.close()
    return ports
