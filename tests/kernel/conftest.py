"""Kernel-test fixtures. Every test under tests/kernel/ is a kernel test
(marked here, from the directory: a module cannot forget its mark and so
escape the matrix's guests). Tests that take `mode` run once per attach
mechanism and program variant that this kernel accepts, as the loader's own
probing finds them (never a list of what some kernel is known to do)."""
import base64
import functools
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import pyroute2.config

from exporter import config, features, loader

# pyroute2 gives the child process that creates a network namespace 2 s to
# answer; under emulation (the kernel matrix's guests) forking takes longer.
pyroute2.config.default_communicate_timeout = 120
from exporter.app import Nettap


def emulated(host: int, guest: int) -> int:
    """A repetition count: `host` here, `guest` in the kernel matrix's qemu
    guests (NETTAP_TEST_VARIANTS=default), where every step costs ~10-20x
    under emulation. For loops that test user-space behaviour the kernel's
    version does not change (how many concurrent scrapes agree), never for
    what the kernel does."""
    return guest if os.environ.get("NETTAP_TEST_VARIANTS") == "default" else host


@functools.lru_cache(maxsize=None)
def kernel_modes() -> tuple:
    """(mechanism, variant) pairs this kernel accepts, e.g. ('tracepoint', 'fast').

    NETTAP_TEST_VARIANTS=default keeps only the variant nettap would choose
    here (the kernel matrix's guests, where every test costs ~10x under
    emulation: 6.1 runs compat, 6.12 fast); unset, every variant the kernel
    accepts runs."""
    if os.geteuid() != 0:
        return ()
    loader.ensure_tracefs()
    variants = [v for v in features.VARIANTS if _variant_ok(v)]
    if os.environ.get("NETTAP_TEST_VARIANTS") == "default":
        variants = variants[:1]                   # VARIANTS is ordered best first
    modes = []
    for mech in loader.MECHANISMS:
        states = loader.plan(mech).states
        if all(st.mechanism == mech for st in states.values()):
            modes += [(mech, v) for v in variants]
    return tuple(modes)


def _variant_ok(variant: str) -> bool:
    try:
        loader.plan("tracepoint", variant)
        return True
    except features.Unsupported:
        return False


HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)      # before -m selects, and before the root conftest's skip
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.kernel)


def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        modes = kernel_modes()
        if not modes and os.geteuid() == 0:
            raise RuntimeError("the loader found no mechanism this kernel accepts")
        metafunc.parametrize("mode", modes or [("unprobed", "not root")],
                             ids=[f"{m}-{v}" for m, v in modes] or ["not-root"])


class Run:
    """A Nettap loaded in this process with a jsonl sink under tmp_path,
    forced to one (mechanism, variant) when mode is given."""

    def __init__(self, tmp_path, doc, mode=None, kernel_plan=None):
        self.out = tmp_path / "capture.jsonl"
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out)})
        self.cfg = config.parse(doc)
        mech, variant = mode or (None, None)
        probes = loader.Probes(self.cfg.ring_bytes, kernel_plan=kernel_plan) if kernel_plan else None
        self.app = Nettap(self.cfg, mechanism=mech, variant=variant, probes=probes)
        if mode:
            assert {st.mechanism for st in self.app.probes.states.values()} == {mech}
            assert self.app.probes.variant == variant

    def counters(self):
        return self.app.counters()

    def drops(self):
        return self.app.drops()

    def apply(self, doc):
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out)})
        self.app.apply(config.parse(doc))

    def finish(self):
        """Stop (last drain, sink flushed) and return the JSON lines."""
        rings = dict(self.app.rings)
        self.app.close()
        drained = {name: r.drained for name, r in rings.items()}
        lines = [json.loads(l) for l in self.out.read_text().splitlines()] if self.out.exists() else []
        return lines, drained


def streams(lines, direction):
    """conn_id -> bytes of that direction, reassembled by offset."""
    parts = defaultdict(list)
    for l in lines:
        if l["type"] == "chunk" and l["direction"] == direction:
            parts[l["conn_id"]].append((l["offset"], base64.b64decode(l["data"])))
    out = {}
    for cid, ps in parts.items():
        ps.sort()
        buf = b""
        for off, d in ps:
            assert off == len(buf), f"conn {cid}: gap or overlap at {off} (have {len(buf)})"
            buf += d
        out[cid] = buf
    return out


@pytest.fixture
def nettap_run(tmp_path, request):
    """make(doc): a Run in the test's mode (when the test takes one)."""
    runs = []
    mode = request.getfixturevalue("mode") if "mode" in request.fixturenames else None

    def make(doc):
        r = Run(tmp_path, doc, mode)
        runs.append(r)
        return r
    yield make
    for r in runs:
        r.app.close()
