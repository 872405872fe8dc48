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

from exporter.config import ConfigError, quote
from exporter.ingest.batches import token
from exporter.util.schema import Bool, Check, Choice, Int, Key, Section, Str, as_written

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def duration(v, key: str) -> float:
    """Seconds: a number, or a string like 500ms, 5s, 20m, 12h, 7d."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    m = _DURATION.match(v) if isinstance(v, str) else None
    if not m:
        raise ConfigError(f"{key}: must be a duration in seconds or like 5s, 20m, 7d, got {quote(v)}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _file(v, key: str) -> str:
    path = Str()(v, key)
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {path} is not a file")
    return path


def _stream_name(name, key: str) -> str:
    if not isinstance(name, str) or not _STREAM_NAME.match(name):
        raise ConfigError(f"{key}: must be 1-64 of A-Z a-z 0-9 _ -, got {quote(name)}")
    return name


def _stream_bytes(v, key: str) -> int:
    return v if v == -1 else Int(1 << 20, 1 << 50)(v, key)


DURATION = Check(duration, "duration: seconds, or like 500ms, 5s, 20m, 7d")
FILE = Check(_file, "path of a file")
SECRET = Check(lambda v, key: Str()(v, key), "string")
TLS = Section("ingest.tls",
    Key("ca_file", FILE, None, "CA the servers' certificates are checked against (default: the system's)"),
    Key("cert_file", FILE, None, "a client certificate (mutual TLS), with key_file"),
    Key("key_file", FILE, None, "the client certificate's key"),
    Key("server_name", as_written("string"), None, "the name the server's certificate must have"))
STREAM = Section("ingest.stream",
    Key("name", Check(_stream_name, "1-64 of A-Z a-z 0-9 _ -"), "NETTAP", "the JetStream stream the messages go to"),
    Key("create", Bool(), True, "create it when missing (subjects nettap.*.*); false: it must exist"),
    Key("replicas", Int(1, 5), 1, "3 for a cluster: a node lost loses nothing"),
    Key("storage", Choice("file", "memory"), "file", "the stream's storage"),
    Key("max_age", DURATION, 7 * 86400.0, "messages older are removed by the engine", "7d"),
    Key("max_bytes", Check(_stream_bytes, "-1 (no limit), or 2^20 .. 2^50"), -1, "the stream's size bound"),
    Key("duplicate_window", DURATION, 1200.0, "how long the engine remembers message ids; at most max_age", "20m"))
INGEST = Section("ingest",
    Key("servers", as_written("list of URLs"), ["nats://127.0.0.1:4222"],
        "nats:// or tls:// URLs of the cluster's nodes"),
    Key("node", as_written("string"), None, "[A-Za-z0-9_-], others become _", "$NODE_NAME, else the host name"),
    Key("subject", Str(), "nettap.{node}.{kind}", "the subject of each message: {node} and {kind} (the records' type)"),
    Key("checkpoint", Str(), None, "what the engine acknowledged, kept across restarts", "beside output.path, hidden"),
    Key("user", Str(), None, "at most one way to authenticate: user and password, token or nkey_file"),
    Key("password", SECRET, None, "or password_file"),
    Key("password_file", FILE, None, "a file holding it (a mounted Secret)"),
    Key("token", SECRET, None, "or token_file"),
    Key("token_file", FILE, None, "a file holding it (a mounted Secret)"),
    Key("nkey_file", FILE, None, "an nkey seed (needs the nkeys package)"),
    Key("tls", TLS, None), Key("stream", STREAM, None),
    Key("batch_bytes", Int(1024, 1 << 20), 256 << 10, "a region of complete lines is cut at most this long"),
    Key("max_in_flight_bytes", as_written("integer, batch_bytes .. 2^30"), 2 << 20,
        "regions sent and not yet acknowledged (held in memory)"),
    Key("ack_timeout", DURATION, 5.0, "then a message is sent again, under the same id", "5s"),
    Key("connect_timeout", DURATION, 5.0, "a connection attempt's bound", "5s"))


class Stream(namedtuple("Stream", STREAM.names, defaults=STREAM.defaults(STREAM.names))):
    __slots__ = ()


class Tls(namedtuple("Tls", TLS.names, defaults=TLS.defaults(TLS.names))):
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


def _secret(sec: dict, key: str, file_key: str):
    if key in sec and file_key in sec:
        raise ConfigError(f"ingest.{key}: give {key} or {file_key}, not both")
    if file_key in sec:
        path = Str()(sec[file_key], f"ingest.{file_key}")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(4096).strip()
        except OSError as e:
            raise ConfigError(f"ingest.{file_key}: cannot read {path}: {e.strerror}") from None
    return None if key not in sec else INGEST.get(sec, key)


def _servers(v) -> tuple:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v:
        raise ConfigError(f"ingest.servers: must be a list of URLs like nats://host:4222, got {quote(v)}")
    for i, u in enumerate(v):
        if not isinstance(u, str) or not re.match(r"^(nats|tls)://[^\s/]+$", u):
            raise ConfigError(f"ingest.servers[{i}]: must be a URL like nats://host:4222 or tls://host:4222, "
                              f"got {quote(u)}")
    return tuple(v)


def _tls(v):
    if v is None:
        return None
    t = TLS.mapping(v)
    cert, key = t.get("cert_file"), t.get("key_file")
    if (cert is None) != (key is None):
        raise ConfigError("ingest.tls: give cert_file and key_file together (a client certificate)")
    return Tls(*(TLS.get(t, k) if k in t else None for k in TLS.names))


def _stream(v) -> Stream:
    st = STREAM.mapping(v)
    name, create = STREAM.get(st, "name"), STREAM.get(st, "create")
    max_age, window = STREAM.get(st, "max_age"), STREAM.get(st, "duplicate_window")
    if max_age and window > max_age:
        raise ConfigError(f"ingest.stream.duplicate_window: {window:g}s is longer than max_age ({max_age:g}s), "
                          "which the engine refuses")
    max_bytes = STREAM.get(st, "max_bytes")
    return Stream(name, create, STREAM.get(st, "replicas"), STREAM.get(st, "storage"), max_age, max_bytes, window)


def default_checkpoint(path: str) -> str:
    """Beside the files, hidden: `nettap read capture.jsonl*` must not read it."""
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.ingest")


def parse(sec, output) -> Settings:
    """The ingest section (a mapping from the YAML) and the config's Output."""
    if sec is None:
        raise ConfigError("ingest: missing: say where the engine is (ingest: {servers: [nats://host:4222]})")
    sec = INGEST.mapping(sec)
    if output.type != "jsonl":
        raise ConfigError(f"ingest: forwards the capture's files: output.type must be jsonl, got {output.type}")
    if output.backups < 1:
        raise ConfigError("ingest: output.backups must be at least 1: with 0 a full file is deleted at once, "
                          "before ingest can forward its last lines")
    user, password = sec.get("user"), _secret(sec, "password", "password_file")
    tok = _secret(sec, "token", "token_file")
    nkey = INGEST.get(sec, "nkey_file") if "nkey_file" in sec else None
    if user is not None:
        user = INGEST.get(sec, "user")
        if password is None:
            raise ConfigError("ingest.user: needs password or password_file")
    elif password is not None:
        raise ConfigError("ingest.password: needs user")
    if sum(x is not None for x in (user, tok, nkey)) > 1:
        raise ConfigError("ingest: give one way to authenticate: user and password, token, or nkey_file")
    node = sec.get("node") or os.environ.get("NODE_NAME") or socket.gethostname()
    subject = INGEST.get(sec, "subject")
    if "{kind}" not in subject or "{node}" not in subject:
        raise ConfigError(f"ingest.subject: must contain {{node}} and {{kind}}, got {quote(subject)}")
    try:
        subject.format(node="n", kind="k")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"ingest.subject: only {{node}} and {{kind}} may be replaced, got {quote(subject)} "
                          f"({e})") from None
    if not re.match(r"^[A-Za-z0-9_.{}-]+$", subject) or ".." in subject:
        raise ConfigError(f"ingest.subject: tokens of A-Z a-z 0-9 _ - separated by dots, got {quote(subject)}")
    batch = INGEST.get(sec, "batch_bytes")
    settings = Settings(_servers(sec.get("servers", INGEST.default("servers"))), token(str(node)), subject,
                        INGEST.get(sec, "checkpoint", default_checkpoint(output.path)),
                        user, password, tok, nkey, _tls(sec.get("tls")), _stream(sec.get("stream")), batch,
                        Int(batch, 1 << 30)(sec.get("max_in_flight_bytes", INGEST.default("max_in_flight_bytes")),
                                            "ingest.max_in_flight_bytes"),
                        INGEST.get(sec, "ack_timeout"), INGEST.get(sec, "connect_timeout"))
    if settings.tls is not None:
        import ssl
        try:
            settings.auth_options()             # the certificates and key load now, or the file is refused
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"ingest.tls: cannot use the certificate files: {e}") from None
    return settings
