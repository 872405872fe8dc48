"""What an idle nettap imports (issue 31): numpy (~15 MB of RSS, ~45 ms of
start) only once something is copied out of a ring or decoded, never on the
path of a nettap that captures nothing and is scraped. The kernel test
tests/kernel/test_run_script.py checks the running process's own mappings;
this checks the modules that path imports, without root."""
from __future__ import annotations

import subprocess
import sys

IDLE_PATH = ("exporter.commands.cli", "exporter.commands.start", "exporter.commands.daemon",
             "exporter.capture.pipeline", "exporter.capture.ringbuf", "exporter.metrics.pipeline",
             "exporter.metrics.lifecycle", "exporter.metrics.maps",
             "exporter.web.server", "exporter.kernel.maps", "exporter.kernel._native")


def _modules_after(code: str) -> set:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


def test_the_idle_path_does_not_import_numpy():
    mods = _modules_after("\n".join(f"import {m}" for m in IDLE_PATH))
    assert set(IDLE_PATH) <= mods
    assert "numpy" not in mods


def test_a_record_layout_imports_numpy_when_first_used():
    mods = _modules_after("from exporter.capture import records\nassert records.CHUNK.itemsize > 0")
    assert "numpy" in mods
