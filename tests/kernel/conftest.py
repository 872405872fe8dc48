"""Kernel-test fixtures. Every test under tests/kernel/ is a kernel test
(marked here, from the directory: a module cannot forget its mark and so
escape the matrix's guests). Tests that take `mode` run once per attach
mechanism and program variant that this kernel accepts, as the loader's own
probing finds them (never a list of what some kernel is known to do)."""
import base64
import contextlib
import functools
import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import pyroute2.config

from exporter import config
from exporter.commands.daemon import Nettap
from exporter.kernel import features, loader, maps, mechanisms, tcp_h, tls, uprobe_multi

# pyroute2 gives the child process that creates a network namespace 2 s to
# answer; under emulation (the kernel matrix's guests) forking takes longer.
pyroute2.config.default_communicate_timeout = 120


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
    mechanisms.ensure_tracefs()
    variants = [v for v in features.VARIANTS if _variant_ok(v)]
    if os.environ.get("NETTAP_TEST_VARIANTS") == "default":
        variants = variants[:1]                   # VARIANTS is ordered best first
    modes = []
    for mech in mechanisms.MECHANISMS:
        states = mechanisms.plan(mech).states
        if all(st.mechanism == mech for st in states.values()):
            modes += [(mech, v) for v in variants]
    return tuple(modes)


def compat_plan_without(*missing: str):
    """The compat tracepoint plan as on a kernel without the features named
    (features.py): the loader then takes their older paths on this one."""
    kp = mechanisms.plan("tracepoint", "compat")
    for f in kp.features:
        if f.name in missing:
            f.present = False
    return kp


def _variant_ok(variant: str) -> bool:
    try:
        mechanisms.plan("tracepoint", variant)
        return True
    except features.Unsupported:
        return False


HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)      # before -m selects, and before the root conftest's skip
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.kernel)


IDLE_AT = pytest.StashKey[float]()


def cpu_idle() -> float:
    """Seconds this machine's CPUs have idled since boot, summed over them
    (/proc/stat's idle and iowait)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[IDLE_AT] = cpu_idle()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's idle seconds (setup to teardown: what its CPUs spent
    waiting, in CPU-seconds) as a junit property: in the kernel matrix's guests
    a test that waits on the clock leaves the host's CPU to nobody, and
    scripts/kernel_matrix.py names the tests that wait most."""
    if call.when == "teardown" and IDLE_AT in item.stash:
        item.user_properties.append(("idle_s", f"{cpu_idle() - item.stash[IDLE_AT]:.1f}"))
    yield



@pytest.fixture(scope="session", autouse=True)
def tracefs():
    """tracefs mounted, as root's nettap leaves it: a test of a nettap
    without the capability to mount it runs alone as well as after others."""
    if os.geteuid() == 0:
        mechanisms.ensure_tracefs()


def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        modes = kernel_modes()
        if not modes and os.geteuid() == 0:
            raise RuntimeError("the loader found no mechanism this kernel accepts")
        if metafunc.definition.get_closest_marker("per_variant"):
            modes = per_variant(modes)
        # module scope: a module's tests are grouped by mode, so one shared
        # nettap per module x mode serves them (shared_nettap)
        metafunc.parametrize("mode", modes or [("unprobed", "not root")], scope="module",
                             ids=[f"{m}-{v}" for m, v in modes] or ["not-root"])


def per_variant(modes) -> tuple:
    """The last mechanism of each variant (the host's own, tracepoint): a test
    of what no mechanism changes (the TLS files, uprobes and the dlopen ring;
    a thread's exit) runs once per variant, not once per mechanism, and in
    the kernel matrix's lighter 6.1-rt shard."""
    last = {v: (m, v) for m, v in modes}
    return tuple(mv for mv in modes if mv in last.values())


# The tests check every record kind; segments only where a target asks (all: every target's).
EVERY_KIND = [k for k in config.RECORD_KINDS if k != "segment"]


class Run:
    """A Nettap loaded in this process with a jsonl sink under tmp_path,
    forced to one (mechanism, variant) when mode is given."""

    def __init__(self, tmp_path, doc, mode=None, kernel_plan=None):
        self.out = tmp_path / "capture.jsonl"
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out), "root": str(self.out.parent)})
        doc["capture"] = {"records": EVERY_KIND, **(doc.get("capture") or {})}
        self.cfg = config.parse(doc)
        mech, variant = mode or (None, None)
        probes = loader.Probes(self.cfg.ring_bytes, kernel_plan=kernel_plan) if kernel_plan else None
        self.app = Nettap(self.cfg, mechanism=mech, variant=variant, probes=probes)
        if mode:
            assert {st.mechanism for st in self.app.probes.states.values()} == {mech}
            assert self.app.probes.variant == variant
        self.settle()

    def settle(self):
        """The TLS files' look that a start or an apply asked for, done: the
        loader waits for it up to 6 s, and the guests, beside other work on
        the host, take longer (a test's traffic then runs before the uprobes)."""
        tls = self.app.probes.tls if self.app.probes else None
        assert tls is None or tls.scan(emulated(30, 120), ask=False), "the look for libssl files goes on"

    def counters(self):
        return self.app.counters()

    def drops(self):
        return self.app.drops()

    def obs_counts(self):
        return self.app.obs_counts()

    def apply(self, doc):
        doc = dict(doc)
        doc.setdefault("output", {"type": "jsonl", "path": str(self.out), "root": str(self.out.parent)})
        doc["capture"] = {"records": EVERY_KIND, **(doc.get("capture") or {})}
        self.app.apply(config.parse(doc))
        self.settle()

    def finish(self):
        """Stop (last drain, sink flushed) and return the JSON lines."""
        rings = dict(self.app.rings)
        self.app.close()
        drained = {name: r.drained for name, r in rings.items()}
        lines = [json.loads(l) for l in self.out.read_text().splitlines()] if self.out.exists() else []
        self.window_lines = records_only(lines)
        return self.window_lines, drained


def records_only(lines):
    """The captured records of lines: without the runs' start, stop and clock
    lines (exporter/capture/sinks.py mark_line, pipeline.py's clock track;
    tests/e2e/test_sink_stop.py and test_capture.py check those)."""
    return [l for l in lines if l["type"] not in ("start", "stop", "clock")]


def streams(lines, direction, tls=False):
    """conn_id -> bytes of that direction, reassembled by offset: the TCP
    bytes, or with tls the TLS plaintext (its own offsets)."""
    parts = defaultdict(list)
    for l in lines:
        if l["type"] == "chunk" and l["direction"] == direction and ("tls" in l["flags"]) == tls:
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


class Shared:
    """One Run per test module x (mechanism, variant), retargeted between
    tests by the live reload (Nettap.apply: the target maps and capture
    settings rewritten, no program reloaded), as a config edit does in
    production. Loading and attaching cost little; detaching waits for the
    kernel, and ~10x that in the emulated guests. Each test gets a
    :class:`Window` of its own."""

    def __init__(self, tmp_path, mode):
        self.run = Run(tmp_path, {"captures": []}, mode)
        self.app = self.run.app
        self.seen = set()                  # conn_ids of the windows before

    def quiet(self, timeout=None):
        """Wait until every record published so far is written (or counted
        lost): each ring empty, and the sink has what the drain took."""
        app = self.app
        end = time.monotonic() + (timeout or emulated(30, 120))
        settled = 0
        while time.monotonic() < end:
            pipe, totals = app.pipeline, app.sink_totals
            done = sum(totals.written.values()) + totals.lost + pipe.lost["queue"] + pipe.lost["decode"]
            empty = all(r.pending_bytes() == 0 for r in app.rings.values())
            # twice in a row: the drain releases a ring a moment before it counts what it took
            settled = settled + 1 if empty and done >= sum(r.drained for r in app.rings.values()) else 0
            if settled == 2:
                return
            time.sleep(0.005)
        raise AssertionError("the shared nettap's rings and sink did not settle")

    def close(self):
        self.app.close()


def dropped_children(lines):
    """conn_ids of server sockets the kernel made and dropped at birth: a
    child whose whole life is LISTEN -> SYN_RECV -> CLOSE, no byte moved (two
    CPUs completed one handshake and the loser was closed at once, or the
    accept queue was full: tcp_check_req). nettap decides a server's socket
    at its birth, so each is a connection of its own, eof and all; a test
    counting one connection per client leaves them out. Seen in the emulated
    guests under load (6.1, two guests at a time)."""
    states, busy = {}, set()
    for l in lines:
        if l["type"] == "state":
            states.setdefault(l["conn_id"], []).append((l["oldstate"], l["newstate"]))
        elif l["type"] == "chunk":
            busy.add(l["conn_id"])
    return {c for c, s in states.items()
            if s == [("LISTEN", "SYN_RECV"), ("SYN_RECV", "CLOSE")] and c not in busy}


def kernel_cgroups(run) -> set:
    """The cgroup ids in the kernel's capture_cgroups map now."""
    return {int.from_bytes(k, "little") for k in maps.keys(run.app.probes.map_fds["capture_cgroups"], 8)}


def wait_until(pred, timeout=60.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def live_conn_ids(app):
    """The conn_ids in the kernel's connection table now (bpf/conn.bpf.h:
    struct conn starts with its id)."""
    fd = app.probes.map_fds["capture_conns"]
    size = app.probes.map_info["capture_conns"][2]
    ids = set()
    for key in maps.keys(fd, 8):
        value = maps.lookup(fd, key, size)
        if value:
            ids.add(int.from_bytes(value[:8], "little"))
    return ids


def conn_slots_total(app):
    """The sum of the counts in capture_conns_slots (bpf/conn.bpf.h: two
    32-bit slots to a word): every entry of the connection table counted once
    in its socket's slot, so always its number of entries once no program
    runs. Each of capture_conns_groups' counts must then be the sum of its
    group's slots (64 consecutive ones); checked here."""
    fd = app.probes.map_fds["capture_conns_slots"]
    _, _, size, entries = app.probes.map_info["capture_conns_slots"]
    slots = []
    for i in range(entries):
        word = int.from_bytes(maps.lookup(fd, i.to_bytes(4, "little"), size), "little")
        slots += [word & 0xffffffff, word >> 32]
    fd = app.probes.map_fds["capture_conns_groups"]
    _, _, size, _ = app.probes.map_info["capture_conns_groups"]
    raw = maps.lookup(fd, (0).to_bytes(4, "little"), size)
    groups = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, size, 4)]
    per = len(slots) // len(groups)
    assert groups == [sum(slots[g * per:(g + 1) * per]) for g in range(len(groups))], (groups, slots)
    return sum(slots)


class Window:
    """A test's part of a Shared Run, with the Run's interface: retargeted to
    the test's doc; counters, drops and drained records counted from the
    test's start; the lines written since, less those of earlier tests'
    connections (a socket an earlier test left open may close now)."""

    def __init__(self, shared, doc):
        self.shared, self.app, self.out = shared, shared.app, shared.run.out
        # Connections still in the table are earlier tests' (a socket left
        # open, a kretprobe's lost return): their records are not this test's.
        shared.seen |= live_conn_ids(self.app)
        self.apply(doc)
        shared.quiet()
        self.offset = self.out.stat().st_size if self.out.exists() else 0
        self._counters, self._drops = self.app.counters(), self.app.drops()
        self._obs = np.array(self.app.obs_counts(), dtype=np.uint64)
        self._drained = {n: r.drained for n, r in self.app.rings.items()}
        self._by_kind = self._kinds_drained()

    def counters(self):
        return {p: {k: v - self._counters[p][k] for k, v in c.items()} for p, c in self.app.counters().items()}

    def drops(self):
        return {r: v - self._drops[r] for r, v in self.app.drops().items()}

    def obs_counts(self):
        """The obs_counters rows (NETTAP_OBS_*) since the test's start."""
        return np.array(self.app.obs_counts(), dtype=np.uint64) - self._obs

    def _kinds_drained(self):
        return sum(np.frombuffer(r.kind_drained, dtype=np.uint64) for r in self.app.rings.values())

    def apply(self, doc):
        self.shared.run.apply(doc)

    def finish(self):
        """Everything published so far written, then this test's lines;
        targets emptied, so nothing more is captured for it."""
        self.shared.quiet()
        with open(self.out, "rb") as f:
            f.seek(self.offset)
            lines = records_only([json.loads(l) for l in f.read().splitlines()])
        drained = {n: r.drained - self._drained[n] for n, r in self.app.rings.items()}
        by_kind = self._kinds_drained() - self._by_kind
        self.kinds_drained = {kind: int(by_kind[n]) for n, kind in tcp_h.NAMES["KIND"].items() if by_kind[n]}
        self.apply({"captures": []})
        self.window_lines = lines             # every connection's: what the kernel counters count
        mine = [l for l in lines if l.get("conn_id") not in self.shared.seen]
        self.shared.seen |= {l["conn_id"] for l in lines if l.get("conn_id")}     # 0: no connection
        return mine, drained


@pytest.fixture(scope="module")
def shared_nettap(request, tmp_path_factory, mode):
    """The module's Shared Run in this mode (made at its first use)."""
    runs = []

    def get():
        if not runs:
            runs.append(Shared(tmp_path_factory.mktemp("shared"), mode))
        return runs[0]
    yield get
    for r in runs:
        r.close()


@pytest.fixture
def nettap_run(tmp_path, request):
    """make(doc): a Run in the test's mode (when the test takes one): the
    module's shared one retargeted (a Window), unless the doc sizes rings
    (a restart's change) or the test takes no mode."""
    runs = []
    mode = request.getfixturevalue("mode") if "mode" in request.fixturenames else None

    def make(doc):
        if mode and "rings" not in doc and "output" not in doc:
            return Window(request.getfixturevalue("shared_nettap")(), doc)
        r = Run(tmp_path, doc, mode)
        runs.append(r)
        return r
    yield make
    for r in runs:
        r.app.close()


@contextlib.contextmanager
def own_netns():
    """A network namespace of the block's own with its loopback up (where its
    nftables rules drop what the test wants lost); removed with its rules as
    the block ends."""
    import uuid
    from pyroute2 import NetNS, netns
    name = f"nettap-test-{uuid.uuid4().hex[:8]}"
    netns.create(name)
    try:
        with NetNS(name) as n:
            n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
        yield name
    finally:
        netns.remove(name)


@pytest.fixture
def ns():
    """A network namespace of the test's own (own_netns), removed after it."""
    with own_netns() as name:
        yield name


@pytest.fixture(scope="module")
def tls_mech(mode):
    """The TLS uprobes' mechanism in this module x mode: uprobe_multi links
    where the kernel has them (6.6+), but perf-event uprobes forced
    (NETTAP_TLS_UPROBE) in the compat variant's run, so that both paths run
    on one kernel; perf-event uprobes alone before 6.6."""
    multi = os.geteuid() == 0 and uprobe_multi.supported()[0]
    with pytest.MonkeyPatch.context() as mp:
        if mode[1] == "compat" or not multi:
            mp.setenv(tls.FORCE_ENV, "uprobe")
            yield "uprobe"
        else:
            mp.delenv(tls.FORCE_ENV, raising=False)
            yield "uprobe_multi"


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "k.pem", d / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", crt, "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    return str(crt), str(key)
