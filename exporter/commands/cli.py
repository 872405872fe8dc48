"""nettap's command line: its flags, and which command runs (the daemon's
start is commands/start.py; nettap read, top and size are their own modules)."""
from __future__ import annotations

import argparse
import os
import sys

COMMANDS_HELP = """commands (each has its own --help):
  nettap read FILE...   read capture files back: list connections, print a connection's
                        bytes (--conn ID, --hex), write a pcap for Wireshark (--pcap OUT)
  nettap top            every BPF program on the node, live (runs/s, ns per run, % CPU)
  nettap size --prometheus URL
                        requests and limits from nettap's own series
  nettap ingest --config FILE
                        forward the capture's files to NATS JetStream (the node's second process)
"""


# Old spellings still accepted, each with one warning once logging is set up.
RENAMED = {"--log-level": "--log.level"}


class Version(argparse.Action):
    """--version: the build's fields, as Prometheus' tools print them
    (exporter/metrics/buildinfo.py, nettap_build_info's source too); read
    only when asked (it may run git)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default,
                         help=help or "print the version and build information and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from exporter.metrics.buildinfo import version_text
        sys.stdout.write(version_text(parser.prog))
        parser.exit()


# --log.level: Prometheus' spellings (warn) and Python's (warning); config.LOG_LEVELS's, without
# importing the config (PyYAML) before the kernel is probed
LOG_LEVELS = ("debug", "info", "warn", "warning", "error")


class _Renamed(argparse.Action):
    """Stores the value; remembers an old spelling in namespace.renamed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if option_string in RENAMED:
            namespace.renamed = [*getattr(namespace, "renamed", []), option_string]


def _args(argv: list | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nettap",
                                description="A lean eBPF TCP collector that tells exactly what running it costs.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=COMMANDS_HELP)
    p.add_argument("--config", metavar="FILE", help="YAML config file (default: built-in config, captures nothing)")
    p.add_argument("--web.listen-address", dest="listen", action="append", metavar="HOST:PORT",
                   help="address of /metrics, /stats, /healthz, /readyz (default :42424); repeat it to "
                        "listen on several")
    p.add_argument("--web.config.file", dest="web_config", metavar="FILE",
                   help="TLS and basic auth for the endpoint, in the Prometheus exporter-toolkit format "
                        "(reloaded on change and on SIGHUP)")
    p.add_argument("--mechanism", choices=("fentry", "kprobe", "tracepoint"),
                   help="force one attach mechanism instead of the first the kernel accepts")
    p.add_argument("--variant", choices=("fast", "compat"),
                   help="force the BPF program variant: fast (Linux 6.2+ features) or compat (5.8+); "
                        "default: fast where the kernel has every feature it needs")
    p.add_argument("--check-config", action="store_true", help="validate --config and exit")
    p.add_argument("--preflight", action="store_true",
                   help="load and attach the probes, print each probe's mechanism, release everything and exit "
                        "(0 if all attached)")
    p.add_argument("--decode", metavar="FILE",
                   help="decode raw ring records from FILE to JSON lines on stdout, and exit")
    p.add_argument("--ring", default="capture_chunks", help="with --decode: the ring the records come from")
    p.add_argument("--log.level", "--log-level", dest="log_level", action=_Renamed,
                   choices=LOG_LEVELS, help="override the config's log_level")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), default="logfmt",
                   help="log lines as logfmt key=value pairs (default) or one JSON object each")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics", metavar="PATH",
                   help="path of the metrics (default /metrics)")
    p.add_argument("--version", action=Version)
    args = p.parse_args(argv)
    args.listen = args.listen or [":42424"]
    check_telemetry_path(p, args.telemetry_path)
    return args


def check_telemetry_path(p: argparse.ArgumentParser, path: str) -> None:
    if not path.startswith("/"):
        p.error(f"--web.telemetry-path must start with '/', got {path!r}")


def _decode(path: str, ring: str) -> int:
    from exporter.capture import records
    from exporter.capture.decode import Decoder
    from exporter.util.logsafe import escape
    if ring not in records.RING_KINDS:
        print(f"nettap: --ring must be one of {', '.join(records.RING_KINDS)}", file=sys.stderr)
        return 2
    shown = 0

    def report(offset: int, message: str) -> None:
        nonlocal shown
        shown += 1
        if shown <= 100:                     # an all-garbage input must not flood the terminal
            print(f"nettap: {escape(path)}: offset {offset}: {message}", file=sys.stderr)
    dec = Decoder(ring, report)
    out = sys.stdout.buffer                  # JSON lines are UTF-8, whatever the locale
    try:
        with open(path, "rb") as f:          # streamed: the input may be a device that never ends
            for kind, recs in dec.records(f):
                out.write(records.jsonl(kind, recs))
    except OSError as e:
        print(f"nettap: cannot read {escape(path)}: {e.strerror}", file=sys.stderr)
        return 1
    finally:
        out.flush()
    r = dec.result
    if shown > 100:
        print(f"nettap: {escape(path)}: {shown - 100} more problem(s) not shown", file=sys.stderr)
    if r.bad:
        print(f"nettap: {escape(path)}: {r.records} record(s) decoded, {r.bad} bad record(s) or stretch(es) "
              f"of garbage skipped (in {r.offset} bytes read)", file=sys.stderr)
        return 1
    return 0


# Commands beside the daemon: `nettap top ...`, `nettap size ...`, each with its own flags.
COMMANDS = {"read": "exporter.commands.read", "top": "exporter.commands.top", "size": "exporter.commands.size",
            "ingest": "exporter.commands.ingest"}


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:            # tools with their own signal handling
        import importlib
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    from exporter.commands import start
    early_hup = start.EarlyHangup()             # before anything slow
    args = _args(argv)
    if args.decode:
        return _decode(args.decode, args.ring)
    mechanisms = None
    if not args.check_config:
        try:
            mechanisms = start.probe_kernel_meanwhile(args.mechanism, args.variant)
        except OSError as e:
            print(f"nettap: cannot prepare tracefs: {e.strerror}", file=sys.stderr)
            return 1
    from exporter import config
    try:
        cfg = config.load(args.config) if args.config else config.DEFAULT
    except config.ConfigError as e:
        return start.refused(e)
    web = None
    if args.web_config:
        from exporter.web import webconfig
        try:
            web = webconfig.Web(webconfig.load(args.web_config), args.web_config)
        except config.ConfigError as e:
            return start.refused(e, "web config")
    if args.check_config:
        return _check_config(cfg, args.config)
    renamed = [(old, RENAMED[old]) for old in dict.fromkeys(getattr(args, "renamed", ()))]
    return start.run(args, cfg, web, mechanisms, early_hup, renamed)


def _check_config(cfg, path) -> int:
    """--check-config: what the daemon would refuse at start, refused now."""
    from exporter import config
    from exporter.commands import start
    from exporter.capture.targets import resolve
    try:
        resolve(cfg.captures)                   # as the daemon: each pid, cgroup, netns must exist now
        if cfg.output.type == "jsonl":          # as the daemon opens it (made and removed if missing)
            from exporter.util.outpath import OutputRefused, check
            try:
                check(cfg.output.path, cfg.output.mode, os.geteuid(), cfg.output.root)
            except OutputRefused as e:
                raise config.ConfigError(f"output.path: {e}") from None
    except config.ConfigError as e:
        return start.refused(e)
    print(f"{path}: ok" if path else "no --config, the built-in default config: ok")
    return 0
