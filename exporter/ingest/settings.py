"""The ``ingest:`` section of nettap's config file, validated: where the
engine is, how ingest proves who it is, and the stream (docs/ingest.md).

The capture reads the same file and keeps the section as it is; ingest
reads ``output:`` too, for the files it forwards.
"""
from __future__ import annotations

import os
import re
import socket
from collections import namedtuple

from exporter.config import ConfigError, _choice, _int, _map, _str, quote
from exporter.ingest.batches import token

KEYS = ("servers", "node", "subject", "checkpoint", "user", "password", "password_file", "token", "token_file",
        "nkey_file", "tls", "stream", "batch_bytes", "max_in_flight_bytes", "ack_timeout", "connect_timeout")
STREAM_KEYS = ("name", "create", "replicas", "storage", "max_age", "max_bytes", "duplicate_window")
TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Stream(namedtuple("Stream", "name create replicas storage max_age max_bytes duplicate_window",
                        defaults=("NETTAP", True, 1, "file", 7 * 86400.0, -1, 1200.0))):
    __slots__ = ()


class Tls(namedtuple("Tls", "ca_file cert_file key_file server_name", defaults=(None, None, None, None))):
    __slots__ = ()


class Settings(namedtuple("Settings", "servers node subject checkpoint user password token nkey_file tls stream "
                                      "batch_bytes max_in_flight_bytes ack_timeout connect_timeout")):
    """The section, validated; secrets read from their files already."""

    __slots__ = ()

    def auth_options(self) -> dict:
        """nats.connect's keyword arguments for auth and TLS."""
        o = {}
        if self.user is not None:
            o.update(user=self.user, password=self.password)
        if self.token is not None:
            o["token"] = self.token
        if self.nkey_file is not None:
            o["nkeys_seed"] = self.nkey_file
        if self.tls is not None:
            import ssl
            ctx = ssl.create_default_context(cafile=self.tls.ca_file)
            if self.tls.cert_file:
                ctx.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            o["tls"] = ctx
            if self.tls.server_name:
                o["tls_hostname"] = self.tls.server_name
        return o

    def __repr__(self) -> str:                  # never a secret in a log line
        return (f"Settings(servers={list(self.servers)}, node={self.node!r}, stream={self.stream.name!r}, "
                f"auth={'user' if self.user else 'token' if self.token else 'nkey' if self.nkey_file else 'none'})")


def duration(v, key: str) -> float:
    """Seconds: a number, or a string like 500ms, 5s, 20m, 12h, 7d."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    m = _DURATION.match(v) if isinstance(v, str) else None
    if not m:
        raise ConfigError(f"{key}: must be a duration in seconds or like 5s, 20m, 7d, got {quote(v)}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _secret(sec: dict, key: str, file_key: str):
    if key in sec and file_key in sec:
        raise ConfigError(f"ingest.{key}: give {key} or {file_key}, not both")
    if file_key in sec:
        path = _str(sec[file_key], f"ingest.{file_key}")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(4096).strip()
        except OSError as e:
            raise ConfigError(f"ingest.{file_key}: cannot read {path}: {e.strerror}") from None
    return None if key not in sec else _str(sec[key], f"ingest.{key}")


def _servers(v) -> tuple:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v:
        raise ConfigError(f"ingest.servers: must be a list of URLs like nats://host:4222, got {quote(v)}")
    for i, u in enumerate(v):
        if not isinstance(u, str) or not re.match(r"^(nats|tls)://[^\s/]+$", u):
            raise ConfigError(f"ingest.servers[{i}]: must be a URL like nats://host:4222 or tls://host:4222, "
                              f"got {quote(u)}")
    return tuple(v)


def _file(v, key: str) -> str:
    path = _str(v, key)
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {path} is not a file")
    return path


def _tls(v):
    if v is None:
        return None
    t = _map(v, "ingest.tls", TLS_KEYS)
    cert, key = t.get("cert_file"), t.get("key_file")
    if (cert is None) != (key is None):
        raise ConfigError("ingest.tls: give cert_file and key_file together (a client certificate)")
    return Tls(*(_file(t[k], f"ingest.tls.{k}") if k in t and k != "server_name" else t.get(k) for k in TLS_KEYS))


def _stream(v) -> Stream:
    st = _map(v, "ingest.stream", STREAM_KEYS)
    d = Stream()
    name = st.get("name", d.name)
    if not isinstance(name, str) or not _STREAM_NAME.match(name):
        raise ConfigError(f"ingest.stream.name: must be 1-64 of A-Z a-z 0-9 _ -, got {quote(name)}")
    create = st.get("create", d.create)
    if not isinstance(create, bool):
        raise ConfigError(f"ingest.stream.create: must be true or false, got {quote(create)}")
    max_age = duration(st.get("max_age", d.max_age), "ingest.stream.max_age")
    window = duration(st.get("duplicate_window", d.duplicate_window), "ingest.stream.duplicate_window")
    if max_age and window > max_age:
        raise ConfigError(f"ingest.stream.duplicate_window: {window:g}s is longer than max_age ({max_age:g}s), "
                          "which the engine refuses")
    max_bytes = st.get("max_bytes", d.max_bytes)
    if max_bytes != -1:
        max_bytes = _int(max_bytes, "ingest.stream.max_bytes", 1 << 20, 1 << 50)
    return Stream(name, create, _int(st.get("replicas", d.replicas), "ingest.stream.replicas", 1, 5),
                  _choice(st.get("storage", d.storage), "ingest.stream.storage", ("file", "memory")),
                  max_age, max_bytes, window)


def default_checkpoint(path: str) -> str:
    """Beside the files, hidden: `nettap read capture.jsonl*` must not read it."""
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.ingest")


def parse(sec, output) -> Settings:
    """The ingest section (a mapping from the YAML) and the config's Output."""
    if sec is None:
        raise ConfigError("ingest: missing: say where the engine is (ingest: {servers: [nats://host:4222]})")
    sec = _map(sec, "ingest", KEYS)
    if output.type != "jsonl":
        raise ConfigError(f"ingest: forwards the capture's files: output.type must be jsonl, got {output.type}")
    if output.backups < 1:
        raise ConfigError("ingest: output.backups must be at least 1: with 0 a full file is deleted at once, "
                          "before ingest can forward its last lines")
    user, password = sec.get("user"), _secret(sec, "password", "password_file")
    tok = _secret(sec, "token", "token_file")
    nkey = _file(sec["nkey_file"], "ingest.nkey_file") if "nkey_file" in sec else None
    if user is not None:
        user = _str(user, "ingest.user")
        if password is None:
            raise ConfigError("ingest.user: needs password or password_file")
    elif password is not None:
        raise ConfigError("ingest.password: needs user")
    if sum(x is not None for x in (user, tok, nkey)) > 1:
        raise ConfigError("ingest: give one way to authenticate: user and password, token, or nkey_file")
    node = sec.get("node") or os.environ.get("NODE_NAME") or socket.gethostname()
    subject = _str(sec.get("subject", "nettap.{node}.{kind}"), "ingest.subject")
    if "{kind}" not in subject or "{node}" not in subject:
        raise ConfigError(f"ingest.subject: must contain {{node}} and {{kind}}, got {quote(subject)}")
    try:
        subject.format(node="n", kind="k")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"ingest.subject: only {{node}} and {{kind}} may be replaced, got {quote(subject)} "
                          f"({e})") from None
    if not re.match(r"^[A-Za-z0-9_.{}-]+$", subject) or ".." in subject:
        raise ConfigError(f"ingest.subject: tokens of A-Z a-z 0-9 _ - separated by dots, got {quote(subject)}")
    batch = _int(sec.get("batch_bytes", 256 << 10), "ingest.batch_bytes", 1024, 1 << 20)
    settings = Settings(_servers(sec.get("servers", ["nats://127.0.0.1:4222"])), token(str(node)), subject,
                    _str(sec.get("checkpoint", default_checkpoint(output.path)), "ingest.checkpoint"),
                    user, password, tok, nkey, _tls(sec.get("tls")), _stream(sec.get("stream")), batch,
                    _int(sec.get("max_in_flight_bytes", 2 << 20), "ingest.max_in_flight_bytes", batch, 1 << 30),
                    duration(sec.get("ack_timeout", 5.0), "ingest.ack_timeout"),
                    duration(sec.get("connect_timeout", 5.0), "ingest.connect_timeout"))
    if settings.tls is not None:
        import ssl
        try:
            settings.auth_options()             # the certificates and key load now, or the file is refused
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"ingest.tls: cannot use the certificate files: {e}") from None
    return settings
