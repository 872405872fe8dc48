"""``--web.config.file``: TLS, client certificates and basic auth for the
endpoint, in the Prometheus exporter-toolkit's format
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md),
so the file an SRE writes for node_exporter works here.

What the toolkit does, nettap does: relative paths are relative to the
file's directory; a CA without a client auth policy is refused; with
``basic_auth_users`` every path (``/healthz`` and ``/readyz`` included)
needs a user, an unknown user costs the same bcrypt check as a known one
(no user enumeration by timing; nettap checks unknown users against a hash
of the configured users' cost, where the toolkit's fixed one is cost 10),
results are cached, and one check runs at a time (bcrypt is CPU-heavy by
design). Beyond the toolkit (exporter/web/throttle.py): checks that fail
may use at most a quarter of a core; past it an uncached credential from an
address that failed a check within a minute is answered 429
without hashing, so a flood of wrong passwords costs the attacker as much
as nettap. An address with no recent failure is checked whatever the share
(its check goes first), so a scraper whose credential was never verified
gets through a flood from elsewhere, and credentials verified before pass
at once (cached apart from failures, which cannot evict them);
``http_server_config.headers``
takes only the toolkit's five headers. What Python's ssl cannot do the
same way (Go cipher-suite and curve names, requesting a client certificate
without verifying it, inline PEM, SAN allow-lists, rate limits) is refused
by name rather than silently weakened.

The file is bounded and parsed like the config (:mod:`exporter.config`),
reloaded like it (on change and on SIGHUP, the parse in a child process),
and a bad file keeps the one in force.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import os
import re
import ssl
from collections import namedtuple
from typing import Optional, Tuple

from exporter import config
from exporter.util import outpath
from exporter.config import ConfigError, quote
from exporter.util.schema import ANY, Bool, Choice, Key, Section, as_written
from exporter.web.throttle import Throttle

log = logging.getLogger(__name__)

# The toolkit's extraHTTPHeaders: name -> accepted values (None: any).
HEADERS = {"Strict-Transport-Security": None, "X-Content-Type-Options": ("nosniff",),
           "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": None,
           "Content-Security-Policy": None}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
TLS_UNSUPPORTED = {
    "cert": "inline PEM: use cert_file", "key": "inline PEM: use key_file",
    "client_ca": "inline PEM: use client_ca_file",
    "cipher_suites": "Go cipher suite names; OpenSSL's defaults apply (TLS 1.2+ by default)",
    "curve_preferences": "Go curve names; OpenSSL's defaults apply",
    "prefer_server_cipher_suites": "OpenSSL's default order applies",
    "client_allowed_sans": "no SAN allow-list: issue client certificates from a CA used for nettap only",
}
# Go's "fakepassword" hash from the toolkit: checked for unknown users.
FAKE_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
_BCRYPT = re.compile(r"^\$2[abxy]?\$[0-9]{2}\$[./A-Za-z0-9]{53}$")
CACHE_ENTRIES = 1024
FILE = as_written("file name (relative: to the web config's directory)")
VERSION = Choice(*TLS_VERSIONS)
TLS = Section("tls_server_config",
    Key("cert_file", FILE, None, "the server's certificate (PEM); with key_file, turns TLS on"),
    Key("key_file", FILE, None, "its key (PEM)"),
    Key("client_auth_type", Choice(*CLIENT_AUTH), "NoClientCert", "RequireAndVerifyClientCert: mutual TLS"),
    Key("client_ca_file", FILE, None, "CA client certificates are verified against"),
    Key("min_version", VERSION, "TLS12", "the oldest TLS version accepted"),
    Key("max_version", VERSION, "TLS13", "the newest TLS version accepted"),
    unsupported=TLS_UNSUPPORTED)
HTTP = Section("http_server_config",
    Key("http2", Bool(), True, "accepted, no effect (HTTP/1.1 only)"),
    Key("headers", as_written("mapping of header: value"), None, "added to every response: " + ", ".join(HEADERS)))
WEB = Section("",
    Key("tls_server_config", TLS, None), Key("http_server_config", HTTP, None),
    Key("basic_auth_users", as_written("mapping of user: bcrypt hash"), None,
        "every path needs one of these users"),
    where="web config", unsupported={"rate_limit": "put a proxy in front for rate limits"})
TLS_KEYS = TLS.names
OK, DENIED, THROTTLED = "ok", "denied", "throttled"


def _cost(hashed: bytes) -> int:
    return int(hashed.split(b"$")[2])


def _usual_cost(users) -> int:
    """The cost most configured hashes have (the higher on a tie)."""
    costs = [_cost(h) for _, h in users]
    return max(set(costs), key=lambda c: (costs.count(c), c))


class WebConfig(namedtuple("WebConfig", "tls users headers files", defaults=(None, (), (), ()))):
    """tls: an ssl.SSLContext or None (plain HTTP); users: ((name, bcrypt
    hash), ...); headers: ((name, value), ...) added to every response;
    files: the certificate, key and CA paths it was loaded from (watched:
    a rotated certificate is loaded without SIGHUP)."""

    __slots__ = ()

    def describe(self) -> str:
        tls = "off" if self.tls is None else (
            "on" + {ssl.CERT_NONE: "", ssl.CERT_OPTIONAL: ", client certificates verified if given",
                    ssl.CERT_REQUIRED: ", client certificates required"}[self.tls.verify_mode])
        n = len(self.users)
        return f"TLS {tls}; basic auth " + (f"on ({n} user{'s' if n > 1 else ''})" if n else "off")


PLAIN = WebConfig()


def _path(v, key: str, directory: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{key}: must be a file name, got {quote(v)}")
    return os.path.join(directory, v)


PEM_MAX_BYTES = 1 << 20


def _pem(path: str, key: str) -> bytes:
    """A PEM file's bytes: a regular file (never blocks on a FIFO), at most
    PEM_MAX_BYTES; ConfigError naming key and path otherwise."""
    try:
        fd = outpath.open_regular(path)
        try:
            data = os.read(fd, PEM_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {quote(path)}: {e.strerror}") from None
    if len(data) > PEM_MAX_BYTES:
        raise ConfigError(f"{key}: {quote(path)} is larger than {PEM_MAX_BYTES} bytes (a PEM file is a few KiB)")
    return data


@contextlib.contextmanager
def _in_memory(data: bytes):
    """A path OpenSSL can open that holds data (a memfd: never on disk)."""
    fd = os.memfd_create("nettap-pem", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _tls(t: dict, directory: str) -> Tuple[Optional[ssl.SSLContext], Tuple[str, ...]]:
    key = "tls_server_config"
    if not any(t.get(k) for k in ("cert_file", "key_file", "client_ca_file", "client_auth_type")):
        return None, ()                                    # the toolkit's IsEnabled(): plain HTTP
    cert = _path(t.get("cert_file"), f"{key}.cert_file", directory)
    keyf = _path(t.get("key_file"), f"{key}.key_file", directory)
    auth = t.get("client_auth_type") or "NoClientCert"
    if auth in ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert"):
        raise ConfigError(f"{key}.client_auth_type: {auth} (a certificate asked for but not verified) is not "
                          "supported by nettap; use RequireAndVerifyClientCert")
    if auth not in CLIENT_AUTH:
        raise ConfigError(f"{key}.client_auth_type: must be one of {', '.join(CLIENT_AUTH)}, got {quote(auth)}")
    ca = t.get("client_ca_file")
    if ca and auth == "NoClientCert":
        raise ConfigError(f"{key}.client_ca_file: a client CA without a client auth policy "
                          "(set client_auth_type: RequireAndVerifyClientCert)")
    if not ca and auth != "NoClientCert":
        raise ConfigError(f"{key}.client_ca_file: required with client_auth_type {auth}")
    versions = [TLS_VERSIONS[TLS.get(t, k)] for k in ("min_version", "max_version")]
    if versions[0] > versions[1]:
        raise ConfigError(f"{key}: min_version is above max_version")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.minimum_version, ctx.maximum_version = versions
    except ValueError as e:
        raise ConfigError(f"{key}: this OpenSSL refuses the TLS versions: {e}") from None
    # Read here, as regular files of bounded size that never block (a FIFO
    # in a cert's place hung the start and the reload watcher in OpenSSL's
    # open), then handed to OpenSSL from memory: the bytes checked are the
    # bytes loaded.
    pem = {name: _pem(path, f"{key}.{name}") for name, path in (("cert_file", cert), ("key_file", keyf))}
    try:
        with _in_memory(pem["cert_file"]) as cert_path, _in_memory(pem["key_file"]) as key_path:
            ctx.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"{key}: cannot load cert_file {quote(cert)} with key_file {quote(keyf)}: "
                          f"{getattr(e, 'strerror', None) or getattr(e, 'reason', None) or e}") from None
    if ca:
        ca = _path(ca, f"{key}.client_ca_file", directory)
        data = _pem(ca, f"{key}.client_ca_file")
        try:
            ctx.load_verify_locations(cadata=data.decode("ascii", "replace"))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"{key}.client_ca_file: cannot load {quote(ca)}: "
                              f"{getattr(e, 'strerror', None) or getattr(e, 'reason', None) or e}") from None
    ctx.verify_mode = CLIENT_AUTH[auth]
    return ctx, (cert, keyf) + ((ca,) if ca else ())


def parse(doc, directory: str = ".") -> WebConfig:
    """Validate a loaded web config document; relative paths are taken
    from directory (the file's, as the toolkit does)."""
    top = WEB.mapping(doc)
    tls, files = _tls(TLS.mapping(top.get("tls_server_config")), directory)
    http = HTTP.mapping(top.get("http_server_config"))
    HTTP.get(http, "http2")
    headers = []
    for name, value in Section("http_server_config.headers", *(Key(h, ANY) for h in HEADERS)).mapping(
            http.get("headers")).items():
        allowed = HEADERS[name]
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise ConfigError(f"http_server_config.headers.{name}: must be a one-line string, got {quote(value)}")
        if allowed and value not in allowed:
            raise ConfigError(f"http_server_config.headers.{name}: must be one of {', '.join(allowed)}, "
                              f"got {quote(value)}")
        if value:                                          # the toolkit: unset if blank
            headers.append((name, value))
    users = top.get("basic_auth_users")
    if users is None:
        users = {}
    if not isinstance(users, dict):
        raise ConfigError(f"basic_auth_users: must be a mapping of user: bcrypt hash, got {type(users).__name__}")
    for name, h in users.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(f"basic_auth_users: user names are non-empty strings without ':', got {quote(name)}")
        if not isinstance(h, str) or not _BCRYPT.match(h):
            # The value is a secret: named, never quoted.
            raise ConfigError(f"basic_auth_users.{config.key_name(name)}: not a bcrypt hash "
                              "(e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n')")
    return WebConfig(tls, tuple((n, h.encode()) for n, h in users.items()), tuple(headers), files)


def load(path: str) -> WebConfig:
    """Read and check path in this process (at start)."""
    return parse(config.load_yaml(config.read(path), path), os.path.dirname(os.path.abspath(path)))


def load_apart(path: str) -> WebConfig:
    """Like load, the YAML parsed in a child process (live reloads)."""
    directory = os.path.dirname(os.path.abspath(path))
    return config.load_apart(path, parse_doc=lambda doc: parse(doc, directory))


class Web:
    """The web config in force, swapped whole by reload(); checks requests'
    credentials against it. Thread-safe."""
    OK, DENIED, THROTTLED = OK, DENIED, THROTTLED       # check()'s answers

    def __init__(self, current: WebConfig = PLAIN, path: Optional[str] = None):
        self.current = current
        self.path = path
        self._good: dict = {}                      # digests of verified credentials, oldest first
        self._bad: dict = {}                       # digests of refused ones, apart: cannot evict the good
        self._fake: dict = {}                      # cost -> a hash of that cost, for unknown users
        self.throttle = Throttle()                 # who may have a bcrypt check, and when

    def reload(self) -> bool:
        try:
            new = load_apart(self.path)
        except config.Cancelled:
            return False
        except Exception as e:
            why = str(e) if isinstance(e, (ConfigError, OSError)) else f"{type(e).__name__}: {e}"
            log.error("web config reload refused, previous web config stays in force: %s", why)
            return False
        self.current = new
        log.info("web config loaded from %s: %s", self.path, new.describe())
        return True

    def authorized(self, cfg: WebConfig, header: Optional[str], client: Optional[str] = None) -> bool:
        return self.check(cfg, header, client) == OK

    def check(self, cfg: WebConfig, header: Optional[str], client: Optional[str] = None) -> str:
        """OK when an Authorization header passes cfg's basic auth (always,
        when cfg has no users), DENIED when it does not, THROTTLED when it
        would need a bcrypt check and cannot have one now (the caller
        answers 429: see Throttle.run). client: the peer's address."""
        if not cfg.users:
            return OK
        if not header or header[:6].lower() != "basic ":
            return DENIED
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return DENIED
        if not sep:
            return DENIED
        hashed = dict(cfg.users).get(user)
        known = hashed is not None
        # The cache keys on a digest: no password is kept in memory.
        key = hashlib.sha256(b"\0".join((user.encode(), hashed or b"", password.encode()))).digest()
        if key in self._good:
            return OK if known else DENIED
        if key in self._bad:
            return DENIED
        import bcrypt                               # only with basic auth configured
        if not known:                               # the same cost: no user enumeration by timing
            hashed = self._fake_hash(bcrypt, _usual_cost(cfg.users))
        ok = self.throttle.run(client, lambda: _checkpw(bcrypt, password, hashed), lambda ok: ok and known)
        if ok is None:                              # no check now: 429
            return THROTTLED
        cache = self._good if ok and known else self._bad
        if len(cache) >= CACHE_ENTRIES:
            try:
                cache.pop(next(iter(cache)), None)  # the oldest (another worker may evict at once)
            except (StopIteration, RuntimeError):
                pass
        cache[key] = True
        return OK if ok and known else DENIED

    def _fake_hash(self, bcrypt, cost: int) -> bytes:
        h = self._fake.get(cost)
        if h is None:
            h = FAKE_HASH if cost == _cost(FAKE_HASH) else bcrypt.hashpw(b"nettap: no such user",
                                                                        bcrypt.gensalt(cost))
            self._fake[cost] = h
        return h


def _checkpw(bcrypt, password: str, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password.encode(), hashed)
    except ValueError:                          # e.g. a password past bcrypt's 72 bytes
        return False


__all__ = ["Web", "WebConfig", "PLAIN", "load", "load_apart", "parse"]
