"""nettap's command line: flags and wiring only."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from exporter import __version__

log = logging.getLogger("nettap")


COMMANDS_HELP = """commands (each has its own --help):
  nettap read FILE...   read capture files back: list connections, print a connection's
                        bytes (--conn ID, --hex), write a pcap for Wireshark (--pcap OUT)
  nettap top            every BPF program on the node, live (runs/s, ns per run, % CPU)
  nettap size --prometheus URL
                        requests and limits from nettap's own series
"""


# Old spellings still accepted, each with one warning once logging is set up.
RENAMED = {"--log-level": "--log.level"}


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
    p.add_argument("--web.listen-address", dest="listen", default=":42424", metavar="HOST:PORT",
                   help="address of /metrics, /stats, /healthz, /readyz (default :42424)")
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
                   choices=("debug", "info", "warning", "error"), help="override the config's log_level")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), default="logfmt",
                   help="log lines as logfmt key=value pairs (default) or one JSON object each")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics", metavar="PATH",
                   help="path of the metrics (default /metrics)")
    p.add_argument("--version", action="version", version=f"nettap {__version__}")
    args = p.parse_args(argv)
    if not args.telemetry_path.startswith("/"):
        p.error(f"--web.telemetry-path must start with '/', got {args.telemetry_path!r}")
    return args


def _decode(path: str, ring: str) -> int:
    from exporter.capture import records
    from exporter.capture.decode import Decoder
    from exporter.util.logsafe import escape
    if ring not in records.RECORDS:
        print(f"nettap: --ring must be one of {', '.join(records.RECORDS)}", file=sys.stderr)
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
            for recs in dec.records(f):
                out.write(records.jsonl(ring, recs))
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


class _Background(threading.Thread):
    """Runs fn in a thread; result() joins and returns its value or raises."""

    def __init__(self, fn, *args):
        super().__init__(name="nettap-probe-kernel", daemon=True)
        self._fn, self._args, self._value, self._error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as e:
            self._error = e

    def result(self):
        self.join()
        if self._error:
            raise self._error
        return self._value


def _refused(e, what: str = "config") -> int:
    from exporter.util.logsafe import escape
    print(f"nettap: {what} refused: {escape(str(e))}", file=sys.stderr)
    return 2


class _EarlyHangup:
    """SIGHUP's handler from the first moment of main(): its default action
    ends the process, and the real handler needs the config watcher, which
    starts after the probes are attached (a SIGHUP 0.1 s after start killed
    nettap). A SIGHUP before then is remembered and acted on then.

    Until release(), SIGHUP is also blocked (in every thread started
    meanwhile): a signal pending while the kernel verifies a program makes
    BPF_PROG_LOAD fail with EAGAIN (kernel/bpf/verifier.c, do_check), and a
    few SIGHUPs in a row used up libbpf's retries and ended the start."""

    def __init__(self):
        self.pending = False
        signal.signal(signal.SIGHUP, self)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

    def release(self) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})    # a pending one runs now

    def __call__(self, *_):
        self.pending = True


def _probe_kernel_meanwhile(mechanism, variant):
    """Start finding what the kernel accepts (parsing vmlinux BTF, feature
    probes, trying an fexit program: ~25 ms, mostly in libbpf and the kernel,
    outside the GIL) while the main thread imports PyYAML and reads the config."""
    from exporter.kernel.loader import ensure_tracefs, plan
    ensure_tracefs()                            # before any thread: it may unshare the mount namespace
    return _Background(plan, mechanism, variant)


def _load_refused(e: OSError, kernel_plan) -> str:
    """Why the kernel refused the object, in one line: a missing privilege
    only when this process lacks one, else the kernel and its missing features."""
    if isinstance(e, FileNotFoundError):        # not a privilege, not the kernel
        return str(e)
    from exporter.kernel import privileges
    try:
        caps = privileges.current()[0]
    except OSError:
        caps = 0
    need = ("CAP_BPF", "CAP_PERFMON")
    missing = [] if caps & privileges.mask_of(("CAP_SYS_ADMIN",)) else \
        [n for n in need if not caps & privileges.mask_of((n,))]
    if missing:
        return f"{e} (nettap needs root, or {'+'.join(need)}; this process lacks {', '.join(missing)})"
    from exporter.kernel.features import FAST_NEEDS, FLOOR
    needed = FLOOR + (FAST_NEEDS if kernel_plan.variant == "fast" else ())
    absent = [f"{f.name} (Linux {f.since})" for f in kernel_plan.features
              if not f.present and f.name in needed]
    return (f"{e}: kernel {os.uname().release} refused the {kernel_plan.variant} programs"
            + (f"; it lacks {', '.join(absent)}" if absent else "")
            + "; libbpf's log above names the program and the verifier's reason")


def _preflight(probes) -> int:
    """Print what the kernel offers, what was chosen, what attached; release all."""
    kp = probes.plan
    print(f"kernel: {os.uname().release}", flush=True)
    for f in kp.features:
        print(f"feature: {f.name} (Linux {f.since}): {'yes' if f.present else 'no'} [{f.how}]")
    print(f"variant: {kp.variant} ({kp.variant_why})")
    for p, st in probes.states.items():
        why = "; ".join(f"{m}: {r}" for m, r in st.reasons.items())
        print(f"{p}: {st.mechanism if st.attached else 'NOT ATTACHED'} ({why})")
    lc = probes.lifecycle
    print(f"tcp_state (lifecycle): {lc.mechanism if lc.attached else 'NOT ATTACHED: ' + lc.error}", flush=True)
    ok = all(st.attached for st in probes.states.values()) and lc.attached
    probes.close()
    return 0 if ok else 1


class _Endpoint:
    """What the endpoint serves, bound before the collector exists (the
    socket is bound first, and served once set() gave it the collector)."""

    def __init__(self, config_path, telemetry_path: str):
        self.app = self._registry = None
        self.config_path, self.telemetry_path = config_path, telemetry_path
        self._own = []                          # the server's own collectors (serve() registers them)

    def set(self, app) -> None:
        self._registry = app.registry()
        self.app = app

    def register(self, collector) -> None:
        self._own.append(collector)

    def collect(self):                          # the registry's one method the encoders call
        if self._registry:
            yield from self._registry.collect()
        for c in self._own:
            yield from c.collect()

    def stats(self) -> dict:
        return self.app.stats() if self.app else {}

    def not_ready(self):
        return self.app.not_ready() if self.app else "starting"

    def landing(self) -> dict:
        return {**self.app.landing(self.config_path), "telemetry_path": self.telemetry_path}


# Commands beside the daemon: `nettap top ...`, `nettap size ...`, each with its own flags.
COMMANDS = {"read": "exporter.commands.read", "top": "exporter.commands.top", "size": "exporter.commands.size"}


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:            # tools with their own signal handling
        import importlib
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    early_hup = _EarlyHangup()                  # before anything slow
    args = _args(argv)
    if args.decode:
        return _decode(args.decode, args.ring)
    mechanisms = None
    if not args.check_config:
        try:
            mechanisms = _probe_kernel_meanwhile(args.mechanism, args.variant)
        except OSError as e:
            print(f"nettap: cannot prepare tracefs: {e.strerror}", file=sys.stderr)
            return 1
    from exporter import config
    try:
        cfg = config.load(args.config) if args.config else config.DEFAULT
    except config.ConfigError as e:
        return _refused(e)
    web = None
    if args.web_config:
        from exporter.web import webconfig
        try:
            web = webconfig.Web(webconfig.load(args.web_config), args.web_config)
        except config.ConfigError as e:
            return _refused(e, "web config")
    if args.check_config:
        from exporter.capture.targets import resolve
        try:
            resolve(cfg.captures)               # as the daemon: each pid, cgroup, netns must exist now
            if cfg.output.type == "jsonl":      # as the daemon opens it (made and removed if missing)
                from exporter.util.outpath import OutputRefused, check
                try:
                    check(cfg.output.path, cfg.output.mode, os.geteuid())
                except OutputRefused as e:
                    raise config.ConfigError(f"output.path: {e}") from None
        except config.ConfigError as e:
            return _refused(e)
        print(f"{args.config}: ok" if args.config else "no --config, the built-in default config: ok")
        return 0
    level = args.log_level or cfg.log_level
    from exporter.util.logsafe import FORMATTERS, install
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[args.log_format]())
    install(handler)                            # values in messages cannot forge log lines
    logging.basicConfig(level=level.upper(), handlers=[handler])
    for old in dict.fromkeys(getattr(args, "renamed", ())):
        log.warning("%s is deprecated: use %s", old, RENAMED[old])

    endpoint = srv = None
    if not args.preflight:
        # Bind before loading anything: a port in use fails now, not after
        # the load. Served once the collector is up; until then a client
        # waits in the listen backlog.
        from exporter.web.server import serve
        endpoint = _Endpoint(args.config, args.telemetry_path)
        try:
            srv = serve(args.listen, endpoint, endpoint.stats, endpoint.not_ready, web, endpoint.landing,
                        telemetry_path=args.telemetry_path, start=False)
        except (OSError, ValueError) as e:
            print(f"nettap: cannot listen on {args.listen}: {e}", file=sys.stderr)
            return 1

    # Attach first: what only the pipeline needs (numpy) is imported once
    # the probes are in place.
    from exporter.kernel.loader import Probes
    from exporter.capture.targets import resolve
    t0 = time.monotonic()
    from exporter.kernel.features import Unsupported
    kernel_plan = None
    try:
        resolve(cfg.captures)                   # refuse a bad target before loading anything
        kernel_plan = mechanisms.result()
        probes = Probes(ring_sizes=cfg.ring_bytes, kernel_plan=kernel_plan)
    except config.ConfigError as e:
        return _refused(e)
    except Unsupported as e:
        print(f"nettap: cannot run here: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nettap: cannot load probes: {_load_refused(e, kernel_plan) if kernel_plan else e}",
              file=sys.stderr)
        return 1
    attached = time.monotonic() - t0
    if args.preflight:
        return _preflight(probes)
    # Loading and attaching are done: keep only the capabilities a reload
    # may use (exporter/kernel/privileges.py), before any thread starts.
    from exporter.kernel import bpfstats, privileges
    bpfstats.STATE_PROBE.load()                 # the stats-state probe needs CAP_BPF: load it now
    try:
        privileges.drop_after_attach()
    except OSError as e:
        print(f"nettap: cannot drop privileges after attach: {e}", file=sys.stderr)
        probes.close()
        return 1

    from exporter.commands.daemon import Nettap
    from exporter.web.server import serve
    try:
        app = Nettap(cfg, probes=probes, log_level=args.log_level)
    except config.ConfigError as e:
        return _refused(e)
    except OSError as e:
        print(f"nettap: cannot start: {e}", file=sys.stderr)
        return 1
    states = {**app.probes.states, "tcp_state": app.probes.lifecycle}
    up = {p: st.mechanism for p, st in states.items() if st.attached}
    if up:
        log.info("%d of %d probes attached in %.3f s (%s), ready in %.3f s", len(up), len(states), attached,
                 ", ".join(f"{p}={m}" for p, m in up.items()), time.monotonic() - t0)
    else:                                       # the loader logged why, probe by probe
        log.warning("no probe attached, in %.3f s", attached)
    early_hup.release()                         # programs loaded: a SIGHUP cannot fail them now

    app.mark_loaded()
    from exporter.util.watcher import ConfigWatcher
    watchers = []
    if args.config:
        watchers.append(ConfigWatcher(args.config, lambda: app.reload(args.config)).start())
    if web:
        # its certificates too: rotated in place (cert-manager) they are served without SIGHUP
        watchers.append(ConfigWatcher(args.web_config, web.reload, also=lambda: web.current.files).start())
    if watchers:
        signal.signal(signal.SIGHUP, lambda *_: [w.trigger() for w in watchers])
        if early_hup.pending:
            log.info("SIGHUP during start: reloading %s", ", ".join(w.path for w in watchers))
            for w in watchers:
                w.trigger()
    else:                                       # SIGHUP must not end a nettap with no file to reload
        signal.signal(signal.SIGHUP, lambda *_: log.warning("SIGHUP: no --config file to reload"))

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    endpoint.set(app)
    threading.Thread(target=srv.serve_forever, name="nettap-http", daemon=True).start()
    host, port = srv.server_address[:2]
    log.info("nettap %s listening on %s (%s); probes: %s; captures: %s", __version__,
             f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
             web.current.describe() if web else "TLS off; basic auth off",
             ", ".join(f"{p}={up.get(p, 'none')}" for p in states),
             ", ".join(map(str, cfg.captures)) or "none (add captures: to a config file)")
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("shutting down")
        config.cancel_loads()                   # a reload's parse must not hold up the stop
        for w in watchers:
            w.stop()
        srv.shutdown()
        app.close()
    return 0
