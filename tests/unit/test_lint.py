"""The tree is lint-clean, in the test command: ruff with pyproject.toml's rules
over the Python, clang-format with bpf/.clang-format (close to the kernel's own
style) over the BPF C."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"vmlinux.h"}                   # bpftool's, not ours to format


def test_python_is_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    assert ruff.exists(), "ruff is missing from the virtualenv: scripts/setup.sh test installs it"
    r = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bpf_sources_are_clang_formatted():
    tool = shutil.which("clang-format-14") or shutil.which("clang-format")
    assert tool, "clang-format is missing: scripts/setup.sh test installs it (clang-format-14)"
    assert (ROOT / "bpf" / ".clang-format").exists()
    files = sorted(str(p) for p in (ROOT / "bpf").iterdir()
                   if p.suffix in (".c", ".h") and p.name not in GENERATED)
    assert files
    r = subprocess.run([tool, "--dry-run", "--Werror", *files], cwd=ROOT / "bpf",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
