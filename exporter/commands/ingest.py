"""`nettap ingest`: the second process of a node. It forwards the capture's
JSON-lines files to NATS JetStream (exporter/ingest) and serves its own
metrics on :42425 (docs/ingest.md)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from exporter import __version__

log = logging.getLogger("nettap.ingest")
MIN_LINES = 1024             # --check-config refuses an engine whose messages hold fewer bytes of lines


def _args(argv: list) -> argparse.Namespace:
    from exporter.commands.cli import LOG_LEVELS, Version, check_telemetry_path
    p = argparse.ArgumentParser(prog="nettap ingest",
                                description="Forward the capture's JSON-lines files to NATS JetStream, "
                                            "checkpointing only what the engine acknowledged.")
    p.add_argument("--config", metavar="FILE", required=True,
                   help="nettap's config file: its output (the files) and ingest sections")
    p.add_argument("--web.listen-address", dest="listen", action="append", metavar="HOST:PORT",
                   help="address of /metrics, /healthz, /readyz (default :42425); repeat it to listen on several")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics", metavar="PATH",
                   help="path of the metrics (default /metrics)")
    p.add_argument("--web.config.file", dest="web_config", metavar="FILE",
                   help="TLS and basic auth for the endpoint (the exporter-toolkit format)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the config, connect to the engine, check the stream, and exit")
    p.add_argument("--log.level", dest="log_level", choices=LOG_LEVELS,
                   help="override the config's log_level")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), default="logfmt")
    p.add_argument("--nice", type=int, default=10, metavar="N",
                   help="lower ingest's CPU priority by N (default 10; 0 keeps it): under a storm the "
                        "capture's drain, whose rings are small, must win the CPU over ingest, whose "
                        "buffer is the files")
    p.add_argument("--version", action=Version)
    args = p.parse_args(argv)
    args.listen = args.listen or [":42425"]
    check_telemetry_path(p, args.telemetry_path)
    return args


def load(path: str):
    """(config, settings); raises ConfigError."""
    from exporter import config
    from exporter.ingest import settings
    cfg = config.load(path)
    return cfg, settings.parse(cfg.ingest, cfg.output)


async def check(s) -> str:
    """Connect once and look at the stream: what is wrong, or None."""
    import nats
    from exporter.ingest.publisher import StreamError, ensure_stream, fit
    try:
        nc = await asyncio.wait_for(nats.connect(
            servers=list(s.servers), allow_reconnect=False, max_reconnect_attempts=1,
            connect_timeout=s.connect_timeout, error_cb=_quiet, **s.auth_options()), s.connect_timeout * 3)
    except Exception as e:
        return f"cannot connect to {', '.join(s.servers)}: {e or type(e).__name__}"
    try:
        info = await ensure_stream(nc, s)
        said = f"stream {info.config.name}: {info.state.messages} message(s), {info.config.num_replicas} replica(s)"
        most, why = fit(s, nc.max_payload, max(info.config.max_msg_size or 0, 0))
        if most < MIN_LINES:
            raise StreamError(f"{why}: too small for the capture's lines")
        return said + (f"; messages are cut to fit: {why}" if most < s.batch_bytes else "")
    except StreamError as e:
        raise RuntimeError(str(e)) from None
    except Exception as e:
        raise RuntimeError(f"stream {s.stream.name}: {e or type(e).__name__}") from None
    finally:
        await nc.close()


async def _quiet(e) -> None:
    pass


def main(argv: list) -> int:
    from exporter import config
    from exporter.commands.start import _logging, refused
    args = _args(argv)
    try:
        cfg, s = load(args.config)
    except config.ConfigError as e:
        return refused(e)
    if args.check_config:
        try:
            said = asyncio.run(check(s))
        except RuntimeError as e:
            return refused(e, "engine")
        if said.startswith("cannot connect"):
            return refused(said, "engine")
        print(f"{args.config}: ok; {said}")
        return 0
    web = None
    if args.web_config:
        from exporter.web import webconfig
        try:
            web = webconfig.Web(webconfig.load(args.web_config), args.web_config)
        except config.ConfigError as e:
            return refused(e, "web config")
    _logging(args.log_level or cfg.log_level, args.log_format)
    if args.nice > 0:
        import os
        os.nice(args.nice)                      # raising one's niceness needs no privilege
    return _serve(args, cfg, s, web)


def _registry(stats):
    from prometheus_client import CollectorRegistry, gc_collector, platform_collector, process_collector
    from exporter.ingest.stats import StatsCollector
    from exporter.metrics.cgroup import CgroupCollector
    from exporter.metrics.buildinfo import BuildInfoCollector
    from exporter.metrics.guarded import Guarded
    reg = CollectorRegistry(auto_describe=False)
    process_collector.ProcessCollector(registry=reg)
    platform_collector.PlatformCollector(registry=reg)
    gc_collector.GCCollector(registry=reg)
    reg.register(Guarded({"ingest": StatsCollector(stats), "cgroup": CgroupCollector(),
                          "build": BuildInfoCollector()}))
    return reg


def _serve(args, cfg, s, web) -> int:
    from exporter.ingest.service import Service
    from exporter.web.server import serve
    svc = Service(s, cfg.output)
    reg = _registry(svc.stats)

    def not_ready():
        if not svc.ready:
            return "starting"
        if not svc.stats.connected:
            why = svc.publisher.last_error
            return "not connected to the engine" + (f" (the last attempt failed: {why}; see the log)" if why else "")
        return None if svc.publisher.ready else "connected; the stream is not usable yet (see the log)"
    from exporter.web.listen import ListenError, described
    try:
        srv = serve(args.listen, reg, svc.state, not_ready, web, telemetry_path=args.telemetry_path)
    except ListenError as e:
        print(f"nettap ingest: {e}", file=sys.stderr)
        return 1
    log.info("nettap ingest %s: forwarding %s (+%d backups) to %s, stream %s, node %s; listening on %s",
             __version__, cfg.output.path, cfg.output.backups, ",".join(s.servers), s.stream.name, s.node,
             described(srv.addresses))

    async def run():
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        # Its default would end ingest: a SIGHUP sent to reload both processes (the capture reloads).
        loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
            "SIGHUP: ingest reads its config at start only; restart it to apply a change"))
        await svc.run(stopping)
    try:
        asyncio.run(run())
    finally:
        srv.shutdown()
        log.info("stopped")
    return 0

