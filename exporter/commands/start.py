"""The daemon's start, from parsed flags and a loaded config to a serving
nettap, in the order that matters: bind the port before loading anything (a
port in use fails at once), load and attach (importing the server and the
daemon meanwhile, in a thread that ends before the drop), drop privileges
before any thread starts, then build the pipeline and collectors
(commands/daemon.py), watch the config files, serve, and wait for a
signal."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from exporter import __version__

log = logging.getLogger("nettap")
# exporter.config (and PyYAML) is imported where it is used, not here: cli.main
# builds EarlyHangup from this module first, and then imports PyYAML while the
# kernel is probed in another thread (probe_kernel_meanwhile).


class Background(threading.Thread):
    """Runs fn in a thread; result() joins and returns its value or raises."""

    def __init__(self, fn, *args, name: str = "nettap-start"):
        super().__init__(name=name, daemon=True)
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


class EarlyHangup:
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


def probe_kernel_meanwhile(mechanism, variant):
    """Start finding what the kernel accepts (parsing vmlinux BTF, feature
    probes, trying an fexit program: ~25 ms, mostly in libbpf and the kernel,
    outside the GIL) while the main thread imports PyYAML and reads the config."""
    from exporter.kernel.mechanisms import ensure_tracefs, plan
    ensure_tracefs()                            # before any thread: it may unshare the mount namespace
    return Background(plan, mechanism, variant, name="nettap-probe-kernel")


def load_refused(e: OSError, kernel_plan) -> str:
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


def preflight(probes, tls_on: bool = False, dns_on: bool = False) -> int:
    """Print what the kernel offers, what was chosen, what attached; release all."""
    from exporter.kernel import goelf
    kp = probes.plan
    print(f"kernel: {os.uname().release}", flush=True)
    for f in kp.features:
        print(f"feature: {f.name} (Linux {f.since}): {'yes' if f.present else 'no'} [{f.how}]")
    print(f"variant: {kp.variant} ({kp.variant_why})")
    for p, st in probes.states.items():
        why = "; ".join(f"{m}: {r}" for m, r in st.reasons.items())
        print(f"{p}: {st.mechanism if st.attached else 'NOT ATTACHED'} ({why})")
    lc = probes.lifecycle
    print(f"tcp_state (lifecycle): {lc.mechanism if lc.attached else 'NOT ATTACHED: ' + lc.error}")
    for p, st in probes.separate.items():
        print(f"{p} (lifecycle): {st.mechanism if st.attached else st.reported.upper() + ': ' + st.error}")
    probes.set_tls(tls_on)          # every process's files (no target here: as capture.tls_attach node)
    for p, st in probes.tls_states.items():
        files = ", ".join(probes.tls.files_of(p)) if probes.tls else ""
        print(f"{p} (tls): {st.mechanism if st.attached else st.reported.upper() + ': ' + st.error}"
              + (f" on {files}" if st.attached else ""))
    probes.set_dns(dns_on)
    st = probes.dns.state
    print(f"dns: {st.mechanism if st.attached else st.reported.upper() + ': ' + st.error}")
    print("tls: OpenSSL's shared libssl (libssl.so.3, libssl.so.1.1: SSL_write, SSL_write_ex, SSL_read, "
          "SSL_read_ex, SSL_do_handshake), and Go's crypto/tls ((*Conn).Write, (*Conn).Read) in Go "
          f"executables: {goelf.LIMITS}; other TLS linked into a program (BoringSSL, rustls, utls, "
          "quic-go) is not seen (docs/limits.md#tls)")
    sys.stdout.flush()
    ok = all(st.attached for st in probes.states.values()) and lc.attached \
        and all(st.attached for st in probes.separate.values() if st.reported != "unsupported") \
        and all(st.attached for st in [*probes.tls_states.values(), probes.dns.state]
                if st.reported not in ("unsupported", "disabled"))
    probes.close()
    return 0 if ok else 1


class Endpoint:
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


def run(args, cfg, web, mechanisms, early_hup: EarlyHangup, renamed=()) -> int:
    """The daemon (or --preflight): returns its exit status."""
    from exporter import config
    _logging(args.log_level or cfg.log_level, args.log_format)
    for old, new in renamed:
        log.warning("%s is deprecated: use %s", old, new)
    socks = imports = None
    if not args.preflight:
        # Bind before loading anything: a port in use fails now, not after
        # the load. Served once the collector is up; until then a client
        # waits in the listen backlog.
        from exporter.web.listen import ListenError, bind_all
        try:
            socks = bind_all(args.listen)
        except ListenError as e:
            print(f"nettap: {e}", file=sys.stderr)
            return 1
        # What the server and the daemon import (~50 ms: the client
        # library, http.server) is imported while the kernel verifies the
        # programs: the load releases the interpreter lock for ~70 ms. The
        # loader's own imports come first, so no module is imported by
        # both threads at once.
        from exporter.capture import targets  # noqa: F401
        from exporter.kernel import features, loader  # noqa: F401
        imports = Background(_import, ("exporter.web.server", "exporter.commands.daemon"))
    t0 = time.monotonic()
    probes = _attach(cfg, mechanisms)
    if imports is not None:
        imports.result()                        # before the privileges drop: no other thread then
    if isinstance(probes, int):
        return probes
    attached = time.monotonic() - t0
    if args.preflight:
        return preflight(probes, cfg.tls, cfg.dns)
    from exporter.web.server import serve
    endpoint = Endpoint(args.config, args.telemetry_path)
    srv = serve(args.listen, endpoint, endpoint.stats, endpoint.not_ready, web, endpoint.landing,
                telemetry_path=args.telemetry_path, start=False, sock=socks)
    app = _daemon(cfg, probes, args.log_level)
    if isinstance(app, int):
        return app
    _log_attached(app, attached, time.monotonic() - t0)
    early_hup.release()                         # programs loaded: a SIGHUP cannot fail them now
    app.mark_loaded()
    watchers = _watch(args, app, web, early_hup)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    endpoint.set(app)
    threading.Thread(target=srv.serve_forever, name="nettap-http", daemon=True).start()
    from exporter.web.listen import described
    log.info("nettap %s listening on %s (%s); probes: %s; captures: %s", __version__, described(srv.addresses),
             web.current.describe() if web else "TLS off; basic auth off",
             ", ".join(f"{p}={m}" for p, m in _mechanisms(app).items()),
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


def _import(modules) -> None:
    import importlib
    for m in modules:
        importlib.import_module(m)


def _logging(level: str, fmt: str) -> None:
    from exporter.util.logsafe import FORMATTERS, install
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[fmt]())
    install(handler)                            # values in messages cannot forge log lines
    logging.basicConfig(level=level.upper(), handlers=[handler])


def refused(e, what: str = "config") -> int:
    """A refused config or web config: one line, exit status 2."""
    from exporter.util.logsafe import escape
    print(f"nettap: {what} refused: {escape(str(e))}", file=sys.stderr)
    return 2


def _attach(cfg, mechanisms):
    """The probes loaded and attached, or the exit status that says why not.
    What only the pipeline needs is imported once they are in place."""
    from exporter import config
    from exporter.capture.targets import resolve
    from exporter.kernel.features import Unsupported
    from exporter.kernel.loader import Probes
    kernel_plan = None
    try:
        resolve(cfg.captures)                   # refuse a bad target before loading anything
        kernel_plan = mechanisms.result()
        from exporter.kernel.loader import load_at_start, records_at_start
        return Probes(ring_sizes=cfg.ring_bytes, kernel_plan=kernel_plan, dns_now=load_at_start(cfg.dns),
                      tls_now=load_at_start(cfg.tls), records=records_at_start(cfg.kinds))
    except config.ConfigError as e:
        return refused(e)
    except Unsupported as e:
        print(f"nettap: cannot run here: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nettap: cannot load probes: {load_refused(e, kernel_plan) if kernel_plan else e}",
              file=sys.stderr)
        return 1


def _daemon(cfg, probes, log_level):
    """Privileges dropped, then the daemon built on the attached probes; or
    the exit status that says why not."""
    # Loading and attaching are done: keep only the capabilities a reload
    # may use (exporter/kernel/privileges.py), before any thread starts.
    from exporter.kernel import bpfstats, privileges
    bpfstats.STATE_PROBE.load()                 # the stats-state probe needs CAP_BPF: load it now
    try:
        privileges.drop_after_attach(tls=cfg.tls)
    except OSError as e:
        print(f"nettap: cannot drop privileges after attach: {e}", file=sys.stderr)
        probes.close()
        return 1
    from exporter import config
    from exporter.commands.daemon import Nettap
    try:
        return Nettap(cfg, probes=probes, log_level=log_level)
    except config.ConfigError as e:
        return refused(e)
    except OSError as e:
        print(f"nettap: cannot start: {e}", file=sys.stderr)
        return 1


def _mechanisms(app) -> dict:
    """{probe: its mechanism, or none}, the lifecycle probe included."""
    return {p: st.reported for p, st in app.probes.all_states().items()}


def _log_attached(app, attached: float, ready: float) -> None:
    mechs = _mechanisms(app)
    off = ("unsupported", "disabled")           # neither can attach here: not counted
    up = {p: m for p, m in mechs.items() if m not in ("none",) + off}
    if up:
        log.info("%d of %d probes attached in %.3f s (%s), ready in %.3f s", len(up),
                 len([m for m in mechs.values() if m not in off]), attached,
                 ", ".join(f"{p}={m}" for p, m in up.items()), ready)
    else:                                       # the loader logged why, probe by probe
        log.warning("no probe attached, in %.3f s", attached)


def _watch(args, app, web, early_hup: EarlyHangup) -> list:
    """The config files watched and reloaded on change and on SIGHUP."""
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
    return watchers
