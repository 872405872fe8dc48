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

Each program is built for a Go architecture (GOARCH: amd64, arm64), by
default the host's; another is cross-compiled (cgo off, but for BoringCrypto,
which links with aarch64-linux-gnu-gcc / x86_64-linux-gnu-gcc). Its key does
not depend on the host, so an arm64 guest finds what the x86 host built for
it. The first arm64 build cross-compiles the standard library (28 s here,
cold; a PIE or BoringCrypto build another each): the unit tests build only
arm64's plain and stripped variants (one standard library); the arm64 lane
asks for every variant with ``python tests/gobuild.py arm64``.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GO = "/usr/lib/go-1.19/bin/go"
SRC = Path(__file__).resolve().parent / "go"
SETUP = "scripts/setup.sh test (it installs Debian's golang-1.19-go)"
TMP = Path(tempfile.gettempdir()) / "nettap-go"
HOST_GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
CROSS_CC = {"amd64": "x86_64-linux-gnu-gcc", "arm64": "aarch64-linux-gnu-gcc"}

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


def _key(name: str, variant: str, goarch: str) -> str:
    h = hashlib.sha256()
    # "go version go1.19.8 linux/amd64": the toolchain, not the host it runs on
    h.update(subprocess.run([GO, "version"], capture_output=True, check=True).stdout.split()[2])
    h.update(repr((variant, VARIANTS[variant], goarch)).encode())
    for p in sorted((SRC / name).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(SRC)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _built(stem: str, key: str):
    for d in (SRC / ".build", TMP):
        p = d / ("%s-%s" % (stem, key))
        if p.is_file():
            return p
    return None


def build(name: str = "gotls", variant: str = "plain", goarch: str | None = None) -> str:
    """The path of tests/go/<name> built as ``variant`` (see VARIANTS) for
    ``goarch`` (default: the host's), built now if the cache does not have it.
    Raises RuntimeError when Go is missing."""
    goarch = goarch or HOST_GOARCH
    stem = "%s-%s-%s" % (name, variant, goarch)
    ok, why = available()
    if not ok:
        # a guest without the toolchain (the kernel matrix's arm64 root): the one build the host
        # made for it (a build removes its stem's older ones)
        found = sorted((SRC / ".build").glob("%s-*" % stem))
        if len(found) == 1 and not found[0].name.endswith(".tmp"):
            return str(found[0])
        raise RuntimeError(why)
    key = _key(name, variant, goarch)
    done = _built(stem, key)
    if done is not None:
        return str(done)
    cache = _cache_dir()
    out = cache / ("%s-%s" % (stem, key))
    env_extra, flags = VARIANTS[variant]
    env = dict(os.environ, GO111MODULE="off", GOFLAGS="", GOCACHE=str(TMP / "gocache"),
               GOPATH=str(TMP / "gopath"), GOARCH=goarch, **env_extra)
    if goarch != HOST_GOARCH:
        env.update(CGO_ENABLED="0")
        if variant == "boringcrypto":           # cgo: the toolchain's BoringSSL objects
            env.update(CGO_ENABLED="1", CC=CROSS_CC.get(goarch, "gcc"))
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # pytest-xdist workers build one at a time
        if not out.is_file():
            tmp = out.with_name(out.name + ".tmp")
            r = subprocess.run([GO, "build", "-o", str(tmp)] + flags + ["."], cwd=SRC / name, env=env,
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError("go build of %s (%s, %s) failed: %s" % (name, variant, goarch, r.stderr.strip()))
            tmp.rename(out)
            for stale in cache.glob("%s-*" % stem):   # builds of older sources
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
# program the unit and kernel tests run, so the guests' image carries them; arm64's two are the
# unit tests' (test_goelf.py: ARM64_VARIANTS).
PREBUILT = [("gotls", v, None) for v in VARIANTS] + [("notls", "plain", None)] + \
    [("gotls", v, "arm64") for v in ("plain", "stripped")]


# The variants the kernel tests run (tests/kernel/test_gotls.py's fixture)
KERNEL_VARIANTS = ("plain", "stripped", "pie")


def prebuilt(goarchs=()) -> list:
    """PREBUILT, and for each of goarchs the programs the kernel tests run (the kernel matrix's
    arm64 guests, whose root has no Go: scripts/test.sh builds them here first)."""
    return PREBUILT + [(n, v, a) for a in goarchs for n, v in [("gotls", v) for v in KERNEL_VARIANTS] +
                       [("notls", "plain")] if (n, v, a) not in PREBUILT]


if __name__ == "__main__":            # python tests/gobuild.py [--kernel] [GOARCH...]
    # --kernel: only what the kernel tests run, for the host's or each GOARCH (the kernel
    # matrix's packed trees: they wait for these alone, not for what only unit tests run)
    args = sys.argv[1:]
    todo = prebuilt(args) if "--kernel" not in args else \
        [("gotls", v, a) for a in [x for x in args if x != "--kernel"] or [None] for v in KERNEL_VARIANTS]
    for name, variant, goarch in todo:
        start = time.monotonic()
        print("%s (%s, %s): %s, %.1f s" % (name, variant, goarch or HOST_GOARCH, build(name, variant, goarch),
                                           time.monotonic() - start), flush=True)
