"""The compiled ring scan and JSON-lines writer (exporter/capture/_jsonl.c,
scan.c, writer.c: one module), ingest's line split (exporter/ingest/_split.c)
and the per-CPU map sums (exporter/kernel/_native.c), built by `pip install`
(scripts/setup.sh). Required: the first is nettap's only ring reader and
writer (the pure-Python ones are test oracles, tests/oracles.py), the last
keeps numpy off the scrape path, so an install without a C compiler and
Python's headers fails here. jsonl.h holds what the first two share.

A built (non-editable) package also gets the BPF objects (bpf/<arch>/*.bpf.o, as
exporter/bpf/<arch>/) and exporter/_revision.py, what it was built from for
`nettap --version` and nettap_build_info (exporter/util/revision.py): the git
revision and branch ($NETTAP_REVISION and $NETTAP_BRANCH, e.g. Docker build
arguments, else git's), the builder ($NETTAP_BUILD_USER, else user@host) and
the date (UTC, from $SOURCE_DATE_EPOCH where a reproducible build sets it).
Installed, it has neither the checkout's bpf/ nor its .git. An editable
install runs from the checkout and finds both there."""
import getpass
import glob
import os
import socket
import subprocess
import time

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _built():
    """{name: value} for exporter/_revision.py."""
    try:
        user = f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):          # no passwd entry for the uid (a container build)
        user = "unknown"
    when = time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH") or time.time()))
    return {"REVISION": os.environ.get("NETTAP_REVISION", "").strip() or _git("rev-parse", "HEAD") or "unknown",
            "BRANCH": os.environ.get("NETTAP_BRANCH", "").strip() or _git("rev-parse", "--abbrev-ref", "HEAD")
            or "unknown",
            "BUILD_USER": os.environ.get("NETTAP_BUILD_USER", "").strip() or user,
            "BUILD_DATE": time.strftime("%Y%m%d-%H:%M:%S", when)}        # as Prometheus' promu writes it


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        pkg = os.path.join(self.build_lib, "exporter")
        objects = glob.glob(os.path.join(HERE, "bpf", "*", "*.bpf.o"))     # bpf/<arch>/: every architecture's
        if not objects:
            raise SystemExit("setup.py: no bpf/*/*.bpf.o to ship (build them: make -C bpf)")
        for f in objects:
            arch_dir = os.path.join(pkg, "bpf", os.path.basename(os.path.dirname(f)))
            self.mkpath(arch_dir)
            self.copy_file(f, os.path.join(arch_dir, os.path.basename(f)))
        with open(os.path.join(pkg, "_revision.py"), "w") as f:
            f.write('"""Written by setup.py at build time."""\n'
                    + "".join(f"{k} = {v!r}\n" for k, v in _built().items()))


FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
JSONL = ["exporter/capture/_jsonl.c", "exporter/capture/scan.c", "exporter/capture/writer.c"]
JSONL_H = ["exporter/capture/jsonl.h"]
setup(cmdclass={"build_py": BuildPy},
      ext_modules=[Extension("exporter.capture._jsonl", JSONL, depends=JSONL_H, extra_compile_args=FLAGS),
                   Extension("exporter.ingest._split", ["exporter/ingest/_split.c"], depends=JSONL_H,
                             extra_compile_args=FLAGS),
                   Extension("exporter.kernel._native", ["exporter/kernel/_native.c"], extra_compile_args=FLAGS)])
