"""The compiled ring scan and JSON-lines writer (exporter/capture/_jsonl.c,
scan.c, writer.c: one module), ingest's line split (exporter/ingest/_split.c)
and the per-CPU map sums (exporter/kernel/_native.c), built by `pip install`
(scripts/setup.sh). Required: the first is nettap's only ring reader and
writer (the pure-Python ones are test oracles, tests/oracles.py), the last
keeps numpy off the scrape path, so an install without a C compiler and
Python's headers fails here. jsonl.h holds what the first two share.

A built (non-editable) package also gets the BPF objects (bpf/*.bpf.o, as
exporter/bpf/) and exporter/_revision.py, the git revision it was built from
($NETTAP_REVISION, e.g. a Docker build argument, else `git rev-parse HEAD`):
installed, it has neither the checkout's bpf/ nor its .git. An editable
install runs from the checkout and finds both there."""
import glob
import os
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _revision():
    rev = os.environ.get("NETTAP_REVISION", "").strip()
    if rev:
        return rev
    try:
        out = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        pkg = os.path.join(self.build_lib, "exporter")
        objects = glob.glob(os.path.join(HERE, "bpf", "*.bpf.o"))
        if not objects:
            raise SystemExit("setup.py: no bpf/*.bpf.o to ship (build them: make -C bpf)")
        self.mkpath(os.path.join(pkg, "bpf"))
        for f in objects:
            self.copy_file(f, os.path.join(pkg, "bpf", os.path.basename(f)))
        rev = _revision()
        if rev:
            with open(os.path.join(pkg, "_revision.py"), "w") as f:
                f.write(f'"""Written by setup.py at build time."""\nREVISION = {rev!r}\n')


FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
JSONL = ["exporter/capture/_jsonl.c", "exporter/capture/scan.c", "exporter/capture/writer.c"]
JSONL_H = ["exporter/capture/jsonl.h"]
setup(cmdclass={"build_py": BuildPy},
      ext_modules=[Extension("exporter.capture._jsonl", JSONL, depends=JSONL_H, extra_compile_args=FLAGS),
                   Extension("exporter.ingest._split", ["exporter/ingest/_split.c"], depends=JSONL_H,
                             extra_compile_args=FLAGS),
                   Extension("exporter.kernel._native", ["exporter/kernel/_native.c"], extra_compile_args=FLAGS)])
