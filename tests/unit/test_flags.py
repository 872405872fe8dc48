"""The daemon's and ingest's flags as parsed: --version, laid out as
Prometheus' tools print theirs from the fields nettap_build_info has;
--log.level's spellings; --web.listen-address repeated; ingest's
--web.telemetry-path."""
from __future__ import annotations

import logging
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import __version__, config
from exporter.commands import cli, ingest
from exporter.kernel import libbpf

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = re.compile(r"(?P<prog>nettap(?: ingest)?), version (?P<version>\S+) \(branch: (?P<branch>\S+), "
                    r"revision: (?P<revision>\S+)\)\n"
                    r"  build user:       (?P<build_user>\S+)\n"
                    r"  build date:       (?P<build_date>\S+)\n"
                    r"  python version:   (?P<python_version>\S+)\n"
                    r"  libbpf version:   (?P<libbpf_version>\S+)\n"
                    r"  platform:         (?P<platform>linux/\w+)\n\Z")


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("argv, prog", [(["--version"], "nettap"), (["ingest", "--version"], "nettap ingest")])
def test_version_prints_the_build(argv, prog):
    r = subprocess.run([sys.executable, "-m", "exporter", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    m = LAYOUT.match(r.stdout)
    assert m, r.stdout
    assert m.groupdict() == {"prog": prog, "version": __version__, "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
                             "revision": _git("rev-parse", "HEAD"), "build_user": "unknown",
                             "build_date": "unknown", "python_version": platform.python_version(),
                             "libbpf_version": libbpf.version(), "platform": m["platform"]}
    assert m["platform"] in ("linux/amd64", "linux/arm64", f"linux/{platform.machine()}")


def test_version_of_a_build():
    from exporter.metrics.buildinfo import version_text
    built = {"revision": "abc123", "branch": "main", "build_user": "ci@builder", "build_date": "20231114-22:13:20"}
    first, user, date = version_text("nettap", lambda: built).splitlines()[:3]
    assert first == f"nettap, version {__version__} (branch: main, revision: abc123)"
    assert (user, date) == ("  build user:       ci@builder", "  build date:       20231114-22:13:20")


@pytest.mark.parametrize("spelling, level", [("warn", logging.WARNING), ("warning", logging.WARNING),
                                             ("debug", logging.DEBUG), ("error", logging.ERROR)])
def test_log_level_spellings(spelling, level, monkeypatch):
    assert cli._args(["--log.level", spelling]).log_level == spelling
    assert ingest._args(["--config", "x", "--log.level", spelling]).log_level == spelling
    assert config.loads(f"log_level: {spelling}\n").log_level == spelling
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    from exporter.commands.start import _logging
    _logging(spelling, "logfmt")
    assert root.level == level


def test_cli_and_config_spell_the_levels_alike():
    assert cli.LOG_LEVELS == config.LOG_LEVELS


def test_listen_address_repeated_keeps_each():
    assert cli._args([]).listen == [":42424"]
    assert cli._args(["--web.listen-address", "127.0.0.1:9", "--web.listen-address", "[::1]:9"]).listen == [
        "127.0.0.1:9", "[::1]:9"]
    assert ingest._args(["--config", "x"]).listen == [":42425"]
    assert ingest._args(["--config", "x", "--web.listen-address", "127.0.0.1:9",
                         "--web.listen-address", "10.0.0.1:9"]).listen == ["127.0.0.1:9", "10.0.0.1:9"]


def test_ingest_telemetry_path(capsys):
    assert ingest._args(["--config", "x"]).telemetry_path == "/metrics"
    assert ingest._args(["--config", "x", "--web.telemetry-path", "/x/metrics"]).telemetry_path == "/x/metrics"
    with pytest.raises(SystemExit) as e:
        ingest._args(["--config", "x", "--web.telemetry-path", "metrics"])
    assert e.value.code == 2 and "--web.telemetry-path must start with '/', got 'metrics'" in capsys.readouterr().err
