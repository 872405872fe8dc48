"""The tree is lint-clean, in the test command: ruff with pyproject.toml's rules
over the Python, clang-format with bpf/.clang-format (close to the kernel's own
style) over the BPF C and with exporter/.clang-format (CPython's) over the C
extensions."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"vmlinux.h"}                   # bpftool's, not ours to format


def test_python_is_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    assert ruff.exists(), "ruff is missing from the virtualenv: scripts/setup.sh test installs it"
    r = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def clang_format(tool: str, top: Path, files: list) -> subprocess.CompletedProcess:
    """clang-format's check of files against the .clang-format at top."""
    assert (top / ".clang-format").exists()
    return subprocess.run([tool, "--dry-run", "--Werror", *map(str, files)], cwd=top,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("top", ["bpf", "exporter"])
def test_c_sources_are_clang_formatted(top):
    """bpf/'s BPF C in the kernel's style, exporter/'s C extensions in CPython's."""
    tool = shutil.which("clang-format-14") or shutil.which("clang-format")
    assert tool, "clang-format is missing: scripts/setup.sh test installs it (clang-format-14)"
    files = sorted(p for p in (ROOT / top).rglob("*.[ch]") if p.name not in GENERATED)
    assert files
    r = clang_format(tool, ROOT / top, files)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def test_the_format_check_sees_a_misformatted_extension(tmp_path):
    """exporter/.clang-format's check fails on what it must: a C file of the
    extensions' tree written in another style."""
    tool = shutil.which("clang-format-14") or shutil.which("clang-format")
    assert tool
    (tmp_path / ".clang-format").write_text((ROOT / "exporter" / ".clang-format").read_text())
    bad = tmp_path / "bad.c"
    bad.write_text("static int f(int x) {\n\treturn x;\n}\n")
    assert clang_format(tool, tmp_path, [bad]).returncode != 0
    bad.write_text("static int f(int x)\n{\n    return x;\n}\n")
    assert clang_format(tool, tmp_path, [bad]).returncode == 0
