"""nettap's YAML config: parsing and validation, nothing else.

Every error names the key and says why, e.g.
``captures[1].port: must be an integer from 1 to 65535, got 'http'``.
Unknown keys are errors too: a typo must not be silently ignored.

Capture targets are checked here for form only; :mod:`exporter.targets`
checks that they exist (a cgroup path, a netns, a pid) when it resolves them.
"""
from __future__ import annotations

from collections import namedtuple

import yaml

from .tcp_h import CHUNK_DATA, MAX_PAYLOAD_BYTES, RINGS, STRIDES

OUTPUT_TYPES = ("jsonl", "stdout", "none")
STATS_SCOPES = ("own", "node")
TARGET_KINDS = ("pid", "cgroup", "netns", "port")
LOG_LEVELS = ("debug", "info", "warning", "error")
# capture_chunks: 16384 chunk records. Its pages are mapped into nettap, so
# they count in its RSS as well as in the map's kernel memory.
DEFAULT_RING_BYTES = {"capture_chunks": 8 << 20, "capture_eof": 256 << 10, "logs": 64 << 10}


class ConfigError(ValueError):
    """A config that nettap refuses; str() names the key and the reason."""


# namedtuples, not dataclasses: this module is on the path to the probes
# being attached, and importing dataclasses (and typing) costs ~15 ms there.
class Target(namedtuple("Target", "kind value")):
    """kind: pid | cgroup | netns | port; value: int for pid/port, a path
    (or an inode for netns) otherwise."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.kind}={self.value}"


class Output(namedtuple("Output", "type path max_bytes backups queue_records",
                        defaults=("none", None, 100 << 20, 3, 1 << 20))):
    """type: jsonl | stdout | none; the jsonl file rotates at max_bytes
    keeping `backups` old files; queue_records are buffered between the
    drain and the sink."""

    __slots__ = ()


class Config(namedtuple("Config", "captures max_payload_bytes output rings bpf_stats_enabled "
                                  "bpf_stats_scope log_level",
                        defaults=((), 4096, Output(), tuple(DEFAULT_RING_BYTES.items()), False, "own", "info"))):
    __slots__ = ()

    @property
    def ring_bytes(self) -> dict:
        return dict(self.rings)


DEFAULT = Config()


def _int(v, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{key}: must be an integer from {lo} to {hi}, got {v!r}")
    return v


def _str(v, key: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{key}: must be a non-empty string, got {v!r}")
    return v


def _choice(v, key: str, choices: tuple) -> str:
    if v not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {v!r}")
    return v


def _map(v, key: str, allowed: tuple) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key or 'config'}: must be a mapping, got {type(v).__name__}")
    for k in v:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise ConfigError(f"{where}: unknown key (expected one of {', '.join(allowed)})")
    return v


def _target(item, key: str) -> Target:
    if not isinstance(item, dict) or len(item) != 1:
        raise ConfigError(f"{key}: must be a mapping with exactly one of {', '.join(TARGET_KINDS)}, got {item!r}")
    (kind, v), = item.items()
    if kind not in TARGET_KINDS:
        raise ConfigError(f"{key}.{kind}: unknown capture kind (expected one of {', '.join(TARGET_KINDS)})")
    k = f"{key}.{kind}"
    if kind == "port":
        return Target(kind, _int(v, k, 1, 65535))
    if kind == "pid":
        return Target(kind, _int(v, k, 1, 2**22 - 1))     # PID_MAX_LIMIT - 1
    if kind == "netns" and isinstance(v, int) and not isinstance(v, bool):
        return Target(kind, _int(v, k, 1, 2**32 - 1))
    path = _str(v, k)
    if not path.startswith("/"):
        raise ConfigError(f"{k}: must be an absolute path, got {path!r}")
    return Target(kind, path)


def _ring_size(v, key: str, ring: str) -> int:
    n = _int(v, key, 4096, 1 << 30)
    if n & (n - 1):
        raise ConfigError(f"{key}: must be a power of two (the kernel's ring rule), got {n}")
    if n % STRIDES[ring]:
        raise ConfigError(f"{key}: must be a multiple of the record stride {STRIDES[ring]}")
    return n


def parse(doc) -> Config:
    """Validate a loaded YAML document into a Config."""
    top = _map(doc, "", ("captures", "capture", "output", "rings", "diagnostics", "log_level"))
    caps = top.get("captures")
    caps = [] if caps is None else caps
    if not isinstance(caps, list):
        raise ConfigError(f"captures: must be a list, got {type(caps).__name__}")
    captures = tuple(_target(item, f"captures[{i}]") for i, item in enumerate(caps))

    cap = _map(top.get("capture"), "capture", ("max_payload_bytes",))
    max_payload = _int(cap.get("max_payload_bytes", DEFAULT.max_payload_bytes),
                       "capture.max_payload_bytes", 0, MAX_PAYLOAD_BYTES)

    out = _map(top.get("output"), "output", ("type", "path", "max_bytes", "backups", "queue_records"))
    otype = _choice(out.get("type", "none"), "output.type", OUTPUT_TYPES)
    path = out.get("path")
    if otype == "jsonl":
        path = _str(path, "output.path")
    elif path is not None:
        raise ConfigError(f"output.path: only used with type jsonl (type is {otype})")
    output = Output(otype, path,
                    _int(out.get("max_bytes", DEFAULT.output.max_bytes), "output.max_bytes", 4096, 1 << 40),
                    _int(out.get("backups", DEFAULT.output.backups), "output.backups", 0, 1000),
                    _int(out.get("queue_records", DEFAULT.output.queue_records), "output.queue_records", 1024, 1 << 26))

    rings = _map(top.get("rings"), "rings", RINGS)
    ring_bytes = dict(DEFAULT_RING_BYTES)
    for r, v in rings.items():
        ring_bytes[r] = _ring_size(v, f"rings.{r}", r)

    diag = _map(top.get("diagnostics"), "diagnostics", ("bpfStats",))
    stats = _map(diag.get("bpfStats"), "diagnostics.bpfStats", ("enabled", "scope"))
    enabled = stats.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"diagnostics.bpfStats.enabled: must be true or false, got {enabled!r}")
    scope = _choice(stats.get("scope", "own"), "diagnostics.bpfStats.scope", STATS_SCOPES)

    level = _choice(top.get("log_level", "info"), "log_level", LOG_LEVELS)
    return Config(captures, max_payload, output, tuple(ring_bytes.items()), enabled, scope, level)


def loads(text: str, source: str = "<config>") -> Config:
    if not text.strip():
        # Also what a reload sees between an editor's truncate and write:
        # refusing it keeps the captures in force.
        raise ConfigError(f"{source}: the file is empty (write {{}} for the built-in defaults)")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse(doc)


def load(path: str) -> Config:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    return loads(text, path)


__all__ = ["Config", "ConfigError", "Output", "Target", "DEFAULT", "load", "loads", "parse", "CHUNK_DATA"]
