#!/usr/bin/env python3
"""JSON-lines writer benchmark: lines/s of the compiled writer
(exporter/capture/writer.c, records.jsonl) against the pure-Python reference
it is tested against (tests/oracles.py's reference_jsonl: its lines joined and
encoded as a sink writes them), in the same run, on one core.

Record sets, as a storm on loopback produces them: lifecycle (eof)
records, and chunk records carrying 64 bytes and a full chunk's payload; batches of
10,000 records (a ring read). Both writers turn a batch into the bytes a
sink writes; the benchmark checks they are the same bytes, then alternates
the two writers and keeps each one's best round.

With --against REV, the compiled writer of git revision REV is built into a
scratch directory and measured beside today's, alternated in the same run
(before/after a change of the writer), each given the same records in its
own layout (REV's generated exporter/kernel/tcp_h.py): both must write the
same bytes.

Run:  .venv/bin/python bench/writer.py [--cpu N] [--rounds 7] [--batch 10000] [--against REV]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")      # no idle BLAS threads on the pinned core
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exporter.capture import records as R  # noqa: E402
from tests.oracles import reference_jsonl  # noqa: E402


def _loopback(recs: np.ndarray, rng) -> None:
    n = len(recs)
    recs["conn_id"] = np.arange(1, n + 1) * 7919 % 1_000_003
    recs["ts_ns"] = 81_234_567_890_123 + np.arange(n) * 4_321
    recs["pid"] = 4242
    recs["tid"] = 4242 + rng.integers(0, 4, n)
    recs["family"] = socket.AF_INET
    recs["sport"] = rng.integers(32768, 61000, n)
    recs["dport"] = 8080
    lo = socket.inet_aton("127.0.0.1").ljust(16, b"\0")
    recs["saddr"] = lo
    recs["daddr"] = lo
    recs["comm"] = b"python3"


def eof_records(n: int, rng) -> np.ndarray:
    recs = np.zeros(n, R.EOF_)
    recs["kind"] = R.KINDS["capture_eof"]
    _loopback(recs, rng)
    recs["start_ns"] = recs["ts_ns"] - rng.integers(10_000, 2_000_000, n)
    recs["tx_bytes"] = 64 * 3
    recs["rx_bytes"] = 64 * 3
    recs["tx_calls"] = 3
    recs["rx_calls"] = 3
    recs["oldstate"] = rng.choice([4, 9, 8], n)                 # FIN_WAIT1, LAST_ACK, CLOSE_WAIT
    return recs


def chunk_records(n: int, size: int, rng) -> np.ndarray:
    recs = np.zeros(n, R.CHUNK)
    recs["kind"] = R.KINDS["capture_chunks"]
    _loopback(recs, rng)
    recs["direction"] = rng.integers(0, 2, n)
    recs["offset"] = rng.integers(0, 1 << 20, n)
    recs["call_offset"] = recs["offset"]
    recs["call_len"] = size
    recs["len"] = size
    payload = rng.integers(0, 256, (n, R.CHUNK_DATA), dtype=np.uint8)
    payload[:, size:] = 0
    recs["data"] = payload.view(f"V{R.CHUNK_DATA}").reshape(n)
    return recs


def best_rate(fn, ring: str, recs: np.ndarray, seconds: float = 0.25) -> float:
    """Lines/s of one round: as many whole batches as fit in ~seconds."""
    t0 = time.perf_counter()
    k = 0
    while True:
        fn(ring, recs)
        k += 1
        t = time.perf_counter() - t0
        if t >= seconds:
            return k * len(recs) / t


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layouts_of(rev: str) -> dict:
    """ring -> the record dtype of revision rev (from its generated
    exporter/kernel/tcp_h.py), and the ring's kind index in its writer."""
    ns: dict = {}
    text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:exporter/kernel/tcp_h.py"], check=True,
                          capture_output=True).stdout
    exec(compile(text, f"{rev}:tcp_h.py", "exec"), ns)            # plain values only (GENERATED)
    return {ring: (R.dtype_of(struct, ns["STRUCTS"]), i) for i, (_, (ring, struct)) in enumerate(ns["RECORDS"].items())}


def _as(recs: np.ndarray, dt: np.dtype) -> np.ndarray:
    """The same records in another layout: each field by name, a payload
    array cut or padded with NULs (the lines must come out the same)."""
    out = np.zeros(len(recs), dt)
    for name in dt.names:
        if name not in recs.dtype.names:
            continue
        if recs.dtype[name].kind == "V":
            n = min(recs.dtype[name].itemsize, dt[name].itemsize)
            raw = np.zeros((len(recs), dt[name].itemsize), np.uint8)
            raw[:, :n] = np.frombuffer(recs[name].tobytes(), np.uint8).reshape(len(recs), -1)[:, :n]
            out[name] = np.frombuffer(raw.tobytes(), f"V{dt[name].itemsize}")
        else:
            out[name] = recs[name]
    return out


def baseline_writer(rev: str):
    """records.jsonl's signature, by the compiled writer of revision rev
    (built with the flags setup.py uses), given its tables as that revision
    took them and the records in its own layout."""
    tmp = tempfile.mkdtemp(prefix="nettap-writer-")
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:exporter/capture"], check=True,
                           capture_output=True, text=True).stdout.split()
    sources = []                                         # _jsonl.c alone, or with scan.c and writer.c (jsonl.h)
    for name in (n for n in names if n.endswith((".c", ".h"))):
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:exporter/capture/{name}"], check=True,
                                   capture_output=True).stdout)
        sources += [os.path.join(tmp, name)] if name.endswith(".c") else []
    so = os.path.join(tmp, "_jsonl" + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = (sysconfig.get_config_var("CFLAGS") or "").split() + ["-fPIC", "-O2"]   # as setup.py builds it
    subprocess.run(["gcc", *flags, "-shared", "-I", sysconfig.get_paths()["include"], *sources, "-o", so], check=True)
    spec = importlib.util.spec_from_file_location("nettap_baseline._jsonl", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = mod.init.__doc__ or ""
    if "kind_field" in doc:                              # today's tables and layout
        mod.init(*R._writer_tables())
        return lambda ring, recs: mod.format(R.KINDS[ring], recs), lambda ring, recs: recs
    if "enum_tables" in doc:
        raise SystemExit(f"--against {rev}: a table-driven writer before the record header; compare with "
                         "the hand-written writer (b618bbb) or a revision from the header on")
    import json                                          # the hand-written writer: five name tables

    def quoted(names):
        names = dict(enumerate(names)) if not isinstance(names, dict) else names
        return [json.dumps(names[v]).encode() if names.get(v) else None for v in range(max(names) + 1)]
    mod.init(quoted(R.DIRECTIONS), [(bit, json.dumps(n).encode()) for bit, n in R.CHUNK_FLAGS],
             quoted(R.TCP_STATES), quoted(R.LOG_CODES), quoted(R.PROBES))
    layouts = _layouts_of(rev)
    return (lambda ring, recs: mod.format(layouts[ring][1], recs),
            lambda ring, recs: _as(recs, layouts[ring][0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last allowed)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--against", metavar="REV", help="also measure the compiled writer of this git revision")
    a = ap.parse_args()
    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    rng = np.random.default_rng(1)
    sets = [
        ("eof", "capture_eof", eof_records(a.batch, rng)),
        ("chunk 64 B", "capture_chunks", chunk_records(a.batch, 64, rng)),
        (f"chunk {R.CHUNK_DATA} B", "capture_chunks", chunk_records(a.batch, R.CHUNK_DATA, rng)),
    ]
    before, theirs = baseline_writer(a.against) if a.against else (None, None)
    print(f"JSON-lines writer, one core (cpu {cpu}), batches of {a.batch} records, best of {a.rounds} rounds")
    head = f"{'records':<12} {'reference lines/s':>18} {'compiled lines/s':>17} {'ratio':>7} {'bytes/line':>11}"
    print(head + (f" {a.against + ' lines/s':>18} {'now/then':>9}" if before else ""))
    for label, ring, recs in sets:
        out = R.jsonl(ring, recs)
        assert out == reference_jsonl(ring, recs), f"{label}: the writers disagree"
        old = theirs(ring, recs) if before else None             # the same records in its layout
        assert before is None or before(ring, old) == out, f"{label}: {a.against}'s writer writes other bytes"
        ref = comp = then = 0.0
        for _ in range(a.rounds):                               # alternated: the same noise for all
            ref = max(ref, best_rate(reference_jsonl, ring, recs))
            comp = max(comp, best_rate(R.jsonl, ring, recs))
            if before:
                then = max(then, best_rate(before, ring, old))
        line = (f"{label:<12} {ref / 1e6:>16.3f} M {comp / 1e6:>15.2f} M {comp / ref:>6.1f}x "
                f"{len(out) / len(recs):>11.0f}")
        print(line + (f" {then / 1e6:>16.2f} M {comp / then:>8.2f}x" if before else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
