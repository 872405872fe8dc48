"""nettap's YAML config: parsing and validation, nothing else.

Every error names the key and says why, e.g.
``captures[1].port: must be an integer from 1 to 65535, got 'http'``.
Unknown keys are errors too: a typo must not be silently ignored.

Capture targets are checked here for form only; :mod:`exporter.targets`
checks that they exist (a cgroup path, a netns, a pid) when it resolves them.
"""
from __future__ import annotations

import logging
from collections import namedtuple

import yaml

from .tcp_h import CHUNK_DATA, MAX_PAYLOAD_BYTES, RINGS, STRIDES

OUTPUT_TYPES = ("jsonl", "stdout", "none")
STATS_SCOPES = ("own", "node")
TARGET_KINDS = ("pid", "cgroup", "netns", "port")
LOG_LEVELS = ("debug", "info", "warning", "error")
# capture_chunks: 16384 chunk records. Its pages are mapped into nettap, so
# they count in its RSS as well as in the map's kernel memory.
# capture_eof: 16384 eof records (128 bytes each in the ring), sized for a
# node's connection-rate burst: 50,000 captured connections/s with both ends
# captured is 100,000 records/s. The ring wakes the drain once a quarter of
# it is pending (4,096 records, 41 ms at that rate: exporter.targets.
# wakeup_thresholds), and the drain may leave records in it while the sink
# catches up until it is half full (exporter.pipeline): that leaves a late
# drain (a busy node schedules it late) 123 ms of ring to run in. The
# prober's storm (20,000 connections x 3 rounds, 2 records a connection)
# reached about 10,000 connections/s here from Python clients; 256 KiB
# (2,048 records, 20 ms at 100,000/s), drained on the chunk ring's
# threshold, dropped records in every round.
DEFAULT_RING_BYTES = {"capture_chunks": 8 << 20, "capture_eof": 2 << 20, "logs": 64 << 10}
# The user-space queue between drain and sink holds JSON lines, bounded in
# their bytes, so a burst of large payloads cannot grow nettap's memory past
# it; when it is full, records wait in their ring (resident already). 4 MiB
# is ~11,000 lines of 64-byte chunks or ~2,900 of full 400-byte chunks. Peak
# RSS is about idle RSS + the rings + this + one read's lines; measured with
# bench/storm_c.py --bytes 4000 --chunk-ring 8388608 (README): under 64 MB.
DEFAULT_QUEUE_BYTES = 4 << 20
# Captured payload is other processes' traffic: only nettap's user reads it
# unless the config says otherwise (0640 for a log shipper's group).
DEFAULT_FILE_MODE = 0o600


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


class Output(namedtuple("Output", "type path max_bytes backups queue_bytes mode",
                        defaults=("none", None, 100 << 20, 3, DEFAULT_QUEUE_BYTES, DEFAULT_FILE_MODE))):
    """type: jsonl | stdout | none; the jsonl file rotates at max_bytes
    keeping `backups` old files, each created with mode; at most
    queue_bytes of records wait between the drain and the sink (more are
    dropped, whole batches, and counted)."""

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


def _queue_bytes(out: dict) -> int:
    if "queue_records" in out:
        # Deprecated: the queue was bounded in records, whatever their size.
        # Taken as that many chunk records' bytes (the largest record), the
        # bound it used to put on memory.
        if "queue_bytes" in out:
            raise ConfigError("output.queue_records: deprecated alias of output.queue_bytes; give only queue_bytes")
        n = _int(out["queue_records"], "output.queue_records", 1024, 1 << 26)
        logging.getLogger(__name__).warning(
            "output.queue_records is deprecated: read as output.queue_bytes: %d (%d chunk records of %d bytes)",
            n * STRIDES["capture_chunks"], n, STRIDES["capture_chunks"])
        return n * STRIDES["capture_chunks"]
    return _int(out.get("queue_bytes", DEFAULT_QUEUE_BYTES), "output.queue_bytes", 64 << 10, 1 << 40)


def _mode(v) -> int:
    """output.mode: octal, as YAML 1.1 reads 0600, or a string '0600'/'0o600'.
    The owner reads and writes; nobody else writes (nettap refuses such a
    file when it exists, so it must not create one) and nothing executes."""
    n = v
    if isinstance(v, str) and v.strip():
        try:
            n = int(v.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            n = None
    if isinstance(n, bool) or not isinstance(n, int) or n & ~0o644 or n & 0o600 != 0o600:
        raise ConfigError(f"output.mode: must be an octal file mode with read-write for the owner and no "
                          f"write or execute for others, e.g. 0600 or 0640, got {v!r}"
                          + (f" (octal {v:o})" if isinstance(v, int) and not isinstance(v, bool) else ""))
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

    out = _map(top.get("output"), "output", ("type", "path", "max_bytes", "backups", "queue_bytes", "queue_records",
                                              "mode"))
    otype = _choice(out.get("type", "none"), "output.type", OUTPUT_TYPES)
    path = out.get("path")
    if otype == "jsonl":
        path = _str(path, "output.path")
    elif path is not None:
        raise ConfigError(f"output.path: only used with type jsonl (type is {otype})")
    if "mode" in out and otype != "jsonl":
        raise ConfigError(f"output.mode: only used with type jsonl (type is {otype})")
    output = Output(otype, path,
                    _int(out.get("max_bytes", DEFAULT.output.max_bytes), "output.max_bytes", 4096, 1 << 40),
                    _int(out.get("backups", DEFAULT.output.backups), "output.backups", 0, 1000),
                    _queue_bytes(out), _mode(out.get("mode", DEFAULT_FILE_MODE)))

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
