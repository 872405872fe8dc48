"""What a built package carries: the BPF objects (found by the loader from
the installed location) and the git revision it was built from."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from exporter import __version__
from exporter.kernel import arch
from exporter.util.revision import revision

ROOT = Path(__file__).resolve().parents[2]


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_revision_from_a_checkout(tmp_path):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    (tmp_path / "exporter").mkdir()
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "x"], cwd=tmp_path, check=True,
                   env={**os.environ, **env})
    assert revision(str(tmp_path / "exporter")) == _git("rev-parse", "HEAD", cwd=tmp_path)


def test_revision_unknown_outside_a_checkout(tmp_path):
    (tmp_path / "exporter").mkdir()
    assert revision(str(tmp_path / "exporter")) == "unknown"


def test_wheel_ships_the_objects_and_the_revision(tmp_path):
    built = {"SOURCE_DATE_EPOCH": "1700000000", "NETTAP_BUILD_USER": "ci@builder"}     # as a release build sets them
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, timeout=300, env={**os.environ, **built})
    wheel, = (tmp_path / "dist").glob("nettap-*.whl")
    head, branch = _git("rev-parse", "HEAD"), _git("rev-parse", "--abbrev-ref", "HEAD")
    with zipfile.ZipFile(wheel) as z:
        for a in arch.OBJECTS.values():            # every architecture's objects, whatever the build host
            for obj in ("tcp.bpf.o", "tcp_open_loop.bpf.o", "node.bpf.o"):
                assert z.read(f"exporter/bpf/{a}/{obj}") == (ROOT / "bpf" / a / obj).read_bytes()
        assert z.read("exporter/_revision.py").decode().splitlines()[1:] == [
            f"REVISION = {head!r}", f"BRANCH = {branch!r}", "BUILD_USER = 'ci@builder'",
            "BUILD_DATE = '20231114-22:13:20'"]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("NETTAP_BPF_DIR", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", "from exporter.kernel import arch; "
                          "from exporter.util import revision; "
                          "from exporter.metrics.buildinfo import version_text; "
                          "print(arch.BPF_DIR); print(revision.revision()); print(version_text('nettap'))"],
                         cwd=tmp_path, env={**env, "PYTHONPATH": str(site)}, check=True,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert out[:2] == [str(site / "exporter" / "bpf"), head]
    assert out[2:5] == [f"nettap, version {__version__} (branch: {branch}, revision: {head})",
                        "  build user:       ci@builder", "  build date:       20231114-22:13:20"]
