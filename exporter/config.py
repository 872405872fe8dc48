"""nettap's YAML config: parsing and validation, nothing else.

Every error names the key and says why, e.g.
``captures[1].port: must be an integer from 1 to 65535, got 'http'``.
Unknown keys are errors too: a typo must not be silently ignored.

Capture targets are checked here for form only; :mod:`exporter.capture.targets`
checks that they exist (a cgroup path, a netns, a pid) when it resolves them.
"""
from __future__ import annotations

import errno
import logging
import os
from collections import namedtuple

import yaml

from exporter.util import kubeconfig, outpath
from exporter.util.schema import (MAX_QUOTED, Bool, Check, Choice, ConfigError, Int, Key, Section, Str,
                                  as_written, key_name, quote)
from exporter.kernel.tcp_h import CHUNK_DATA, MAX_CHUNKS_PER_CALL, NAMES, RINGS, STRIDES

OUTPUT_TYPES = ("jsonl", "stdout", "none")
STATS_SCOPES = ("own", "node")
TARGET_KINDS = ("pid", "cgroup", "netns", "port", "kubernetes")
TLS_ATTACH = ("targets", "node")
LOG_LEVELS = ("debug", "info", "warn", "warning", "error")     # warn: Prometheus' spelling
MAX_PAYLOAD_BYTES = MAX_CHUNKS_PER_CALL * CHUNK_DATA     # what one call's capture can hold (bpf/tcp.h)
# capture.records: the kinds (lines' "type") about a connection (capture.md#which-records-capturerecords)
RECORD_KINDS = tuple(k for _n, k in sorted(NAMES["KIND"].items()) if k not in ("log", "dlopen", "dns"))
DEFAULT_RECORDS = ("chunk", "eof", "reset", "owner", "error", "tls_handshake", "retransmit", "synack_retransmit")
# capture_chunks: 16384 chunk records. Its pages are mapped into nettap, so they count in its RSS as well as in the
# map's kernel memory.
# capture_eof: 15,420 eof records (136 bytes each in the ring), sized for a node's connection-rate burst: 50,000
# captured connections/s with both ends captured is 100,000 records/s. The ring wakes the drain once a quarter of it
# is pending (3,855 records, 39 ms at that rate: exporter.capture.filter.wakeup_thresholds), and the drain may
# leave records in it while the sink catches up until it is half full (exporter.capture.pipeline): that leaves a
# late drain (a busy node schedules it late) 116 ms of ring to run in. The prober's storm (20,000 connections x 3
# rounds, 2 records a connection) reached about 10,000 connections/s here from Python clients; 256 KiB (2,048
# records, 20 ms at 100,000/s), drained on the chunk ring's threshold, dropped records in every round.
# obs_events: state records (80 bytes in the ring, about five a connection): 13,107 of them, a second of 2,600
# connections/s with both ends captured.
# dns: 1,659 dns records (632 bytes each in the ring), woken at a quarter full (bpf/dns.bpf.c): 1.2 s of 500
# queries/s and their answers left for a late drain (a busy node's, or the first message's), where 128 KiB (207
# records) dropped some of 500 queries/s sent in bursts (bench/dns.py).
DEFAULT_RING_BYTES = {"capture_chunks": 8 << 20, "capture_eof": 2 << 20, "logs": 64 << 10, "obs_events": 1 << 20,
                      "dlopen": 64 << 10, "segments": 256 << 10, "dns": 1 << 20}
# The user-space queue between drain and sink holds JSON lines, bounded in their bytes, so a burst of large payloads
# cannot grow nettap's memory past it; when it is full, records wait in their ring (resident already). 4 MiB is
# ~11,000 lines of 64-byte chunks or ~2,900 of full 400-byte chunks. Peak RSS is about idle RSS + the rings + this +
# one read's lines; measured with bench/storm_c.py --bytes 4000 --chunk-ring 8388608 (docs/benchmarks.md): under 64
# MB.
DEFAULT_QUEUE_BYTES = 4 << 20
# Captured payload is other processes' traffic: only nettap's user reads it
# unless the config says otherwise (0640 for a log shipper's group).
DEFAULT_FILE_MODE = 0o600
# The only directory nettap writes its output in (output.root): output.path
# must be inside it, and directories are made only inside it.
DEFAULT_OUTPUT_ROOT = "/var/lib/nettap"


# Bounds on what a config file may ask of the parser. A real config is a few
# KiB (each target map holds 1,024 entries); these leave room for far more
# and refuse what was measured to hurt: a 50 MB file parsed for over a
# minute at 1.3 GB RSS; 50,000 nested lists overflowed the stack; 218 bytes
# of aliases expanded to a 5.8 MB error message.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32             # nettap's own keys nest 3 deep
MAX_NODES = 100_000        # YAML nodes (scalars, lists, mappings): 33,000 `- port: N` items
PARSE_TIMEOUT = 60.0       # seconds a live reload's parse may take, the interpreter's start included
                           # (MAX_NODES take ~1 s here; an emulated guest starts Python in ~10-20 s)
PARSE_MEMORY = 512 << 20   # address space of the parsing child


class Cancelled(ConfigError):
    """A parse given up because nettap is stopping (not the file's fault)."""


def _ring_size(v, key: str) -> int:
    n = Int(4096, 1 << 30)(v, key)
    if n & (n - 1):
        raise ConfigError(f"{key}: must be a power of two (the kernel's ring rule), got {n}")
    return n


def _records(v, key: str) -> tuple:
    """all, or a list of RECORD_KINDS: the kinds, in kind order."""
    if v == "all":
        return RECORD_KINDS
    if not isinstance(v, (list, tuple)) or not all(isinstance(k, str) for k in v):
        raise ConfigError(f"{key}: must be all or a list of record kinds ({', '.join(RECORD_KINDS)}), "
                          f"got {quote(v)}")
    bad = [k for k in v if k not in RECORD_KINDS]
    if bad:
        raise ConfigError(f"{key}: unknown record kind {quote(bad[0])} (one of {', '.join(RECORD_KINDS)})")
    return tuple(k for k in RECORD_KINDS if k in v)


def _mode(v, key: str = "output.mode") -> int:
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
        raise ConfigError(f"{key}: must be an octal file mode with read-write for the owner and no "
                          f"write or execute for others, e.g. 0600 or 0640, got {v!r}"
                          + (f" (octal {v:o})" if isinstance(v, int) and not isinstance(v, bool) else ""))
    return n


RING_DOCS = {"capture_chunks": "16,384 chunk records", "capture_eof": "15,420 connection ends: a burst of "
             "100,000/s for 154 ms", "logs": "nettap's programs' log lines", "obs_events": "13,107 state changes "
             "of captured sockets (about five a connection)", "dlopen": "819 libssl files mapped or programs run "
             "by processes while capture.tls is on",
             "segments": "2,520 segment records, for the targets with segments on",
             "dns": "1,659 DNS messages, while capture.dns is on"}
# Each key once: its check, default and doc (exporter/util/schema.py); docs/configuration.md's table is
# rendered from these (scripts/gen_config_doc.py).
CAPTURE = Section("capture",
    Key("max_payload_bytes", Int(0, MAX_PAYLOAD_BYTES), 4096,
        "payload captured per call; the call's length is always recorded"),
    Key("tls", Bool(), False, "TLS plaintext of captured sockets from libssl and Go's crypto/tls (capture.md#tls)"),
    Key("tls_attach", Choice(*TLS_ATTACH), "targets",
        "targets: TLS uprobes only on the files the targets' processes map or execute (with a port target, "
        "as node); node: on every libssl file and Go program of the node, a trap in every process's TLS "
        "calls (capture.md#tls)"),
    Key("dns", Bool(), False, "captured workloads' DNS over UDP and TCP (capture.md#dns)"),
    Key("records", Check(_records, "all, or a list of record kinds"), list(DEFAULT_RECORDS),
        "the record kinds published (all: every one); programs only the others need are not attached "
        "(capture.md#which-records-capturerecords)", "[" + ", ".join(DEFAULT_RECORDS) + "]"),
    Key("sample_connections", Int(1, 1 << 24), 1, "capture 1 in N connections, each whole, the same ones at both "
        "ends (capture.md#sampling-capturesample_connections)"))
OUTPUT = Section("output",
    Key("type", Choice(*OUTPUT_TYPES), "none", "where captured records go"),
    Key("path", Str(), None, "the jsonl file: inside root (a relative path is taken from it)"),
    Key("root", Str(), DEFAULT_OUTPUT_ROOT, "the only directory nettap writes in (not /)"),
    Key("max_bytes", Int(4096, 1 << 40), 100 << 20, "no file grows past this size (whole lines)"),
    Key("backups", Int(0, 1000), 3, "rotated files kept (capture.jsonl.1 ...)"),
    Key("queue_bytes", Int(64 << 10, 1 << 40), DEFAULT_QUEUE_BYTES, "JSON lines waiting for the sink, in bytes"),
    Key("queue_records", Int(1024, 1 << 26), None, "deprecated: read as that many chunk records' bytes"),
    Key("mode", Check(_mode, "octal file mode, owner rw, no write for others"), DEFAULT_FILE_MODE,
        "files are created with this mode", "0600"))
RINGS_SECTION = Section("rings", *(Key(r, Check(_ring_size, "bytes, a power of two, 4096 .. 2^30"),
                                       DEFAULT_RING_BYTES[r], RING_DOCS.get(r, "")) for r in RINGS))
BPF_STATS = Section("diagnostics.bpfStats",
    Key("enabled", Bool(), False, "kernel BPF run-time statistics (nettap_bpf_program_*)"),
    Key("scope", Choice(*STATS_SCOPES), "own", "node: also every other BPF program on the node"))
TOP = Section("",
    Key("captures", as_written("list of port, pid, cgroup, netns or kubernetes items"), None,
        "a call is captured if it matches any item (on an item, segments: true: also its segments; records: "
        "its own capture.records)"),
    Key("capture", CAPTURE, None), Key("output", OUTPUT, None), Key("rings", RINGS_SECTION, None),
    Key("diagnostics", Section("diagnostics", Key("bpfStats", BPF_STATS, None)), None),
    Key("kubernetes", kubeconfig.KUBERNETES, None), Key("metrics", kubeconfig.METRICS, None),
    Key("log_level", Choice(*LOG_LEVELS), "info", "overridden by --log.level"),
    Key("ingest", as_written("mapping"), None, "nettap ingest's section (below); the capture keeps it as written"))


# namedtuples, not dataclasses: this module is on the path to the probes
# being attached, and importing dataclasses (and typing) costs ~15 ms there.
class Target(namedtuple("Target", "kind value segments records", defaults=(False, None))):
    """kind: pid | cgroup | netns | port | kubernetes; value: int for pid/port, a path (or an inode for
    netns), a kubeconfig.Selector for kubernetes; segments: record the segments its sockets receive;
    records: the record kinds its sockets publish (its own records:, else capture.records; segment if segments)."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.kind}={self.value}" + (" (segments)" if self.segments else "")


class Output(namedtuple("Output", "type path max_bytes backups queue_bytes mode root",
                        defaults=OUTPUT.defaults(("type", "path", "max_bytes", "backups", "queue_bytes", "mode",
                                                  "root")))):
    """type: jsonl | stdout | none; the jsonl file (path: absolute, inside root) rotates at
    max_bytes keeping `backups` old files, each created with mode; at most queue_bytes of records
    wait between the drain and the sink (more are dropped, whole batches, and counted)."""

    __slots__ = ()


class Config(namedtuple("Config", "captures max_payload_bytes output rings bpf_stats_enabled "
                                  "bpf_stats_scope log_level tls ingest dns tls_attach records sample kube",
                        defaults=((), CAPTURE.default("max_payload_bytes"), Output(),
                                  tuple(DEFAULT_RING_BYTES.items()), BPF_STATS.default("enabled"),
                                  BPF_STATS.default("scope"), TOP.default("log_level"), CAPTURE.default("tls"),
                                  None, CAPTURE.default("dns"), CAPTURE.default("tls_attach"),
                                  tuple(CAPTURE.default("records")), 1, kubeconfig.Kube()))):
    __slots__ = ()

    @property
    def kinds(self) -> frozenset:
        """The record kinds in force: capture.records, and segment where a
        target asks for its sockets' segments."""
        return frozenset(self.records).union(*(t.records or () for t in self.captures))

    @property
    def ring_bytes(self) -> dict:
        return dict(self.rings)


DEFAULT = Config()


def _target(item, key: str) -> Target:
    """One of TARGET_KINDS, segments: true|false (default false), records: its own capture.records."""
    kinds = [k for k in item if k not in ("segments", "records")] if isinstance(item, dict) else ()
    if len(kinds) != 1:
        raise ConfigError(f"{key}: must be a mapping with exactly one of {', '.join(TARGET_KINDS)} "
                          f"(and optionally segments, records), got {quote(item)}")
    kind, v, seg = kinds[0], item[kinds[0]], item.get("segments", False)
    rec = _records(item["records"], f"{key}.records") if "records" in item else None
    if rec == ():
        raise ConfigError(f"{key}.records: must name a record kind at least (or all)")
    if kind not in TARGET_KINDS:
        raise ConfigError(f"{key}.{key_name(kind)}: unknown capture kind (expected one of {', '.join(TARGET_KINDS)})")
    if not isinstance(seg, bool):
        raise ConfigError(f"{key}.segments: must be true or false, got {quote(seg)}")
    k = f"{key}.{kind}"
    if kind in ("port", "pid", "kubernetes"):           # pid: up to PID_MAX_LIMIT - 1
        check = {"port": Int(1, 65535), "pid": Int(1, 2**22 - 1), "kubernetes": kubeconfig.selector}[kind]
        return Target(kind, check(v, k), seg, rec)
    if kind == "netns" and isinstance(v, int) and not isinstance(v, bool):
        return Target(kind, Int(1, 2**32 - 1)(v, k), seg, rec)
    path = Str()(v, k)
    if not path.startswith("/"):
        raise ConfigError(f"{k}: must be an absolute path, got {quote(path)}")
    return Target(kind, path, seg, rec)


def _queue_bytes(out: dict) -> int:
    if "queue_records" in out:
        # Deprecated: the queue was bounded in records, whatever their size.
        # Taken as that many chunk records' bytes (the largest record), the
        # bound it used to put on memory.
        if "queue_bytes" in out:
            raise ConfigError("output.queue_records: deprecated alias of output.queue_bytes; give only queue_bytes")
        n = OUTPUT.get(out, "queue_records")
        logging.getLogger(__name__).warning(
            "output.queue_records is deprecated: read as output.queue_bytes: %d (%d chunk records of %d bytes)",
            n * STRIDES["chunk"], n, STRIDES["chunk"])
        return n * STRIDES["chunk"]
    return OUTPUT.get(out, "queue_bytes")


def parse(doc) -> Config:
    """Validate a loaded YAML document into a Config."""
    top = TOP.mapping(doc)
    caps = top.get("captures")
    caps = [] if caps is None else caps
    if not isinstance(caps, list):
        raise ConfigError(f"captures: must be a list, got {type(caps).__name__}")
    captures = tuple(_target(item, f"captures[{i}]") for i, item in enumerate(caps))

    cap = CAPTURE.mapping(top.get("capture"))
    max_payload, tls, dns, tls_attach, records, sample = (CAPTURE.get(cap, k) for k in (
        "max_payload_bytes", "tls", "dns", "tls_attach", "records", "sample_connections"))
    # each target's kinds: its own records:, else capture.records; and segment with segments: true
    captures = tuple(t._replace(segments=seg, records=tuple(k for k in RECORD_KINDS if k in (t.records or records)
                                                            or k == "segment" and seg))
                     for t, seg in ((t, t.segments or "segment" in (t.records or records)) for t in captures))

    out = OUTPUT.mapping(top.get("output"))
    otype = OUTPUT.get(out, "type")
    for k in ("path", "mode", "root"):
        if out.get(k) is not None and otype != "jsonl":
            raise ConfigError(f"output.{k}: only used with type jsonl (type is {otype})")
    root = os.path.normpath(OUTPUT.get(out, "root"))
    if not root.startswith("/") or root == "/":
        raise ConfigError(f"output.root: must be an absolute path to nettap's own directory (not /), got "
                          f"{quote(out['root'])}")
    path = OUTPUT.get(out, "path") if otype == "jsonl" else None
    if path is not None:
        try:
            path = outpath.under_root(root, path)
        except ValueError:
            raise ConfigError(f"output.path: must name a file inside output.root ({root}; relative paths are "
                              f"taken from it), got {quote(path)}: nettap writes only there") from None
    output = Output(otype, path, OUTPUT.get(out, "max_bytes"), OUTPUT.get(out, "backups"), _queue_bytes(out),
                    OUTPUT.get(out, "mode"), root)

    rings = RINGS_SECTION.mapping(top.get("rings"))
    ring_bytes = dict(DEFAULT_RING_BYTES)
    for r in rings:
        ring_bytes[r] = RINGS_SECTION.get(rings, r)

    diag = TOP.keys["diagnostics"].check.mapping(top.get("diagnostics"))
    stats = BPF_STATS.mapping(diag.get("bpfStats"))
    enabled, scope = BPF_STATS.get(stats, "enabled"), BPF_STATS.get(stats, "scope")

    level = TOP.get(top, "log_level")
    # nettap ingest's section, kept as written: checked by ingest (exporter/ingest/settings.py), which
    # holds its secrets' files; the capture does not use it
    ingest = top.get("ingest")
    if ingest is not None and not isinstance(ingest, dict):
        raise ConfigError(f"ingest: must be a mapping, got {type(ingest).__name__}")
    return Config(captures, max_payload, output, tuple(ring_bytes.items()), enabled, scope, level, tls, ingest,
                  dns, tls_attach, records, sample, kubeconfig.settings(top.get("kubernetes"), top.get("metrics")))


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)     # libyaml: 4x faster


def _check_events(text: str, source: str, loader=_Loader) -> None:
    """Walk the parser's events (no document is built) and refuse, before
    anything is composed, aliases, nesting deeper than MAX_DEPTH and more
    than MAX_NODES nodes."""
    depth = nodes = 0
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, yaml.AliasEvent):
            # Refused, not expanded: a few bytes of aliases make an
            # exponential document (and merge keys copy it).
            m = ev.start_mark
            raise ConfigError(f"{source}: YAML aliases are not supported (*{key_name(ev.anchor)} at line "
                              f"{m.line + 1}, column {m.column + 1}): write the value out")
        if isinstance(ev, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(f"{source}: more than {MAX_NODES} YAML nodes; a config is far smaller")
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                m = ev.start_mark
                raise ConfigError(f"{source}: nested deeper than {MAX_DEPTH} levels at line {m.line + 1}, "
                                  f"column {m.column + 1}")
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(text: str, source: str = "<config>"):
    """The YAML document in text, within the bounds above (ConfigError
    otherwise, one line)."""
    if not text.strip():
        # Also what a reload sees between an editor's truncate and write:
        # refusing it keeps the captures in force.
        raise ConfigError(f"{source}: the file is empty (write {{}} for the built-in defaults)")
    try:
        _check_events(text, source)
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        err = e
    if _Loader is not yaml.SafeLoader:
        # PyYAML's own words for what is wrong (libyaml's are terser): the
        # same bounded walk, in Python, only for a file being refused.
        try:
            _check_events(text, source, yaml.SafeLoader)
            yaml.load(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            err = e
    _yaml_refused(err, source)


def _yaml_refused(e: yaml.YAMLError, source: str):
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = str(getattr(e, "problem", None) or e)
    if len(problem) > 2 * MAX_QUOTED or not problem.isprintable():
        problem = quote(problem)
    raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def loads(text: str, source: str = "<config>") -> Config:
    return parse(load_yaml(text, source))


def read(path: str) -> str:
    """The text of a config file: a regular file of at most MAX_FILE_BYTES,
    in UTF-8 (ConfigError otherwise); a FIFO in its place is refused, never
    waited on (outpath.open_regular)."""
    try:
        fd = outpath.open_regular(path)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}" if e.errno == errno.EINVAL
                          else f"{path}: cannot read: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        data = b""
        while len(data) <= MAX_FILE_BYTES:
            part = os.read(fd, MAX_FILE_BYTES + 1 - len(data))
            if not part:
                break
            data += part
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES} bytes ({max(size, len(data))} bytes); "
                          "a config is a few KiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None


def load(path: str) -> Config:
    return loads(read(path), path)


# -- parsing in a child process --------------------------------------------
# A live reload parses in a short-lived child (exporter/util/apart.py says
# why): the child runs _child, which answers with what yaml.safe_load built.


def load_apart(path: str, parse_doc=parse, timeout: float = PARSE_TIMEOUT):
    """parse_doc(the YAML document in path), the YAML parsed in a child
    process. Raises ConfigError; after cancel_loads(), at once."""
    from exporter.util import apart
    text = read(path)
    try:
        ok, value = apart.run("exporter.config", "_child", path, text.encode(), timeout)
    except apart.Cancelled:
        raise Cancelled(f"{path}: parse cancelled (nettap is stopping)") from None
    except apart.Failed as e:
        raise ConfigError(f"{path}: " + ": ".join([e.args[0], *map(quote, e.args[1:])])) from None
    if not ok:
        raise ConfigError(value)
    return parse_doc(value)


def cancel_loads() -> None:
    """Kill every parsing child and refuse new ones (at stop)."""
    from exporter.util import apart
    apart.cancel()


def _child() -> None:
    import pickle
    import resource
    import sys
    resource.setrlimit(resource.RLIMIT_AS, (PARSE_MEMORY, PARSE_MEMORY))
    source = sys.argv[1]
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
        answer = (True, load_yaml(text, source))
    except ConfigError as e:
        answer = (False, str(e))
    except MemoryError:
        answer = (False, f"{source}: parsing needs more than {PARSE_MEMORY >> 20} MiB")
    sys.stdout.buffer.write(pickle.dumps(answer))


__all__ = ["Config", "ConfigError", "Output", "Target", "DEFAULT", "load", "load_apart", "loads", "parse",
           "read", "CHUNK_DATA"]
