"""The listen socket, bound before anything else (a port in use fails at
once) and without the HTTP server's imports (http.server, the client
library's exposition: ~40 ms), which the daemon makes while the kernel
verifies its programs (commands/start.py)."""
from __future__ import annotations

import re
import socket
from typing import List, Sequence, Tuple

BACKLOG = 1024          # listen(2) backlog (the kernel caps it at net.core.somaxconn)

_LISTEN = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%\w]*:[0-9A-Fa-f:.%\w]*)\]|(?P<host>[^\[\]:]*))"
                     r":(?P<port>[0-9]{1,5})$", re.ASCII)


def parse_listen(addr: str) -> Tuple[str, int]:
    """':42424' -> ('', 42424); '127.0.0.1:9' -> ('127.0.0.1', 9); '[::1]:9' -> ('::1', 9)."""
    m = _LISTEN.match(addr)
    if not m or int(m["port"]) > 65535:
        raise ValueError(f"--web.listen-address: expected HOST:PORT or [IPV6]:PORT, got {addr!r}")
    return (m["v6"] if m["v6"] is not None else m["host"]), int(m["port"])


def _listening(family: int, address: tuple, backlog: int, dual: bool = False) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual:                        # every address, IPv4 included
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(address)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


def bind(addr: str, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket for --web.listen-address. An IPv6 host listens
    on IPv6; an empty host on every address, IPv4 included (dual stack),
    or on every IPv4 address where the host has no IPv6; any other host on
    IPv4. Raises ValueError for a malformed address, OSError for one the
    kernel refuses (in use, not local)."""
    host, port = parse_listen(addr)
    if ":" in host:
        return _listening(socket.AF_INET6, (host, port), backlog)
    if host == "" and socket.has_ipv6:
        try:
            return _listening(socket.AF_INET6, ("::", port), backlog, dual=True)
        except OSError:                 # no IPv6 on this host
            pass
    return _listening(socket.AF_INET, (host, port), backlog)


class ListenError(Exception):
    """An address that cannot be listened on; str(): which one, and why."""

    def __init__(self, addr: str, why: Exception):
        super().__init__(f"cannot listen on {addr}: {why}")
        self.addr, self.why = addr, why


def bind_all(addrs: Sequence[str], backlog: int = BACKLOG) -> List[socket.socket]:
    """A listening socket for each --web.listen-address, in order (the
    exporter toolkit serves every address it is given). Raises ListenError
    for the first malformed address (before any is bound) or the first the
    kernel refuses (in use, not local, given twice); then none stays bound."""
    for addr in addrs:
        try:
            parse_listen(addr)
        except ValueError as e:
            raise ListenError(addr, e) from None
    socks: List[socket.socket] = []
    try:
        for addr in addrs:
            try:
                socks.append(bind(addr, backlog))
            except OSError as e:
                raise ListenError(addr, e) from None
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def described(addresses) -> str:
    """getsockname() addresses as a log line names them: 127.0.0.1:9, [::]:9."""
    return ", ".join(f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}" for a in addresses)
