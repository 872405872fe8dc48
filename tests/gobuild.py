"""Go test programs (tests/go/<name>/) built with Debian's Go 1.19, cached.

A binary is kept under a name keyed by a hash of its sources, the variant and
`go version`, in tests/go/.build/ inside the checkout: the binaries the host's
test run built are already there when the kernel matrix packs the checkout
for its qemu guests (building under TCG is slow). Where that directory is not
writable (a guest's read-only checkout) they go to $TMPDIR/nettap-go.
Go's own build cache (GOCACHE) is $TMPDIR/nettap-go/gocache for every
checkout, never inside one: a PIE or BoringCrypto build first rebuilds
the standard library into it (~40 s each here, ~200 MB in all, which the
guests' packed tree must not carry); later builds take about a second.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

GO = "/usr/lib/go-1.19/bin/go"
SRC = Path(__file__).resolve().parent / "go"
SETUP = "scripts/setup.sh test (it installs Debian's golang-1.19-go)"
TMP = Path(tempfile.gettempdir()) / "nettap-go"

# variant -> (extra environment, extra `go build` flags)
VARIANTS = {
    "plain": ({}, []),
    "stripped": ({}, ["-ldflags=-s -w"]),
    "pie": ({}, ["-buildmode=pie"]),
    "pie_stripped": ({}, ["-buildmode=pie", "-ldflags=-s -w"]),
    # Debian's 1.19 builds it (cgo, the toolchain's bundled BoringSSL objects)
    "boringcrypto": ({"GOEXPERIMENT": "boringcrypto"}, []),
}


def available():
    """(True, "") when the Go toolchain is installed, else (False, what to run)."""
    if os.access(GO, os.X_OK):
        return True, ""
    return False, "%s is not installed: run %s" % (GO, SETUP)


def _cache_dir() -> Path:
    for d in (SRC / ".build", TMP):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise RuntimeError("no writable directory for the Go test programs")


def _key(name: str, variant: str) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([GO, "version"], capture_output=True, check=True).stdout)
    h.update(repr((variant, VARIANTS[variant])).encode())
    for p in sorted((SRC / name).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(SRC)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _built(name: str, variant: str, key: str):
    for d in (SRC / ".build", TMP):
        p = d / ("%s-%s-%s" % (name, variant, key))
        if p.is_file():
            return p
    return None


def build(name: str = "gotls", variant: str = "plain") -> str:
    """The path of tests/go/<name> built as ``variant`` (see VARIANTS), built
    now if the cache does not have it. Raises RuntimeError when Go is missing."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    key = _key(name, variant)
    done = _built(name, variant, key)
    if done is not None:
        return str(done)
    cache = _cache_dir()
    out = cache / ("%s-%s-%s" % (name, variant, key))
    env_extra, flags = VARIANTS[variant]
    env = dict(os.environ, GO111MODULE="off", GOFLAGS="", GOCACHE=str(TMP / "gocache"),
               GOPATH=str(TMP / "gopath"), **env_extra)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # pytest-xdist workers build one at a time
        if not out.is_file():
            tmp = out.with_name(out.name + ".tmp")
            r = subprocess.run([GO, "build", "-o", str(tmp)] + flags + ["."], cwd=SRC / name, env=env,
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError("go build of %s (%s) failed: %s" % (name, variant, r.stderr.strip()))
            tmp.rename(out)
            for stale in cache.glob("%s-%s-*" % (name, variant)):   # builds of older sources
                if stale != out:
                    stale.unlink()
    return str(out)


def msg(i: int, size: int) -> bytes:
    """The bytes of message ``i`` of ``size`` bytes that tests/go/gotls writes and serves:
    (i*131 + k*7 + size) % 251 for k in range(size)."""
    import numpy as np
    k = np.arange(size, dtype=np.int64)
    return ((i * 131 + k * 7 + size) % 251).astype(np.uint8).tobytes()


# What the test command builds before the tests (scripts/test.sh, in the background): every
# program the unit and kernel tests run, so the guests' image carries them.
PREBUILT = [("gotls", v) for v in VARIANTS] + [("notls", "plain")]

if __name__ == "__main__":
    for name, variant in PREBUILT:
        start = time.monotonic()
        print("%s (%s): %s, %.1f s" % (name, variant, build(name, variant), time.monotonic() - start), flush=True)
