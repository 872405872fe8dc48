"""exporter/capture/records.py mirrors bpf/tcp.h: the numpy layouts against the BTF
compiled into bpf/<arch>/tcp.bpf.o (via ``bpftool -j btf dump file``), and the
constants against the #defines of the header text."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from exporter.capture import records as R
from exporter.kernel import arch

ROOT = Path(__file__).resolve().parents[2]
OBJ = Path(arch.object_path("tcp.bpf.o", bpf_dir=str(ROOT / "bpf")))
HEADER = ROOT / "bpf" / "tcp.h"

LAYOUTS = {
    "nettap_hdr": R.HEADER,
    "nettap_chunk": R.CHUNK,
    "nettap_eof": R.EOF_,
    "nettap_log": R.LOG,
    **{f"nettap_{kind}": R.DTYPES[kind] for kind in (
        "state", "reset", "owner", "error", "destroy", "tls_handshake", "dlopen", "retransmit",
        "synack_retransmit", "timer", "probe", "segment", "dns")},
    "nettap_capture_config": R.CAPTURE_CONFIG,
    "nettap_probe_counters": R.PROBE_COUNTERS,
}


def _bpftool() -> str:
    for p in (shutil.which("bpftool"), "/usr/sbin/bpftool", "/usr/bin/bpftool"):
        if p and Path(p).exists():
            return p
    raise AssertionError("bpftool not found (looked in PATH, /usr/sbin, /usr/bin)")


@pytest.fixture(scope="module")
def btf():
    out = subprocess.run([_bpftool(), "-j", "btf", "dump", "file", str(OBJ)],
                         check=True, capture_output=True, timeout=60).stdout
    return {t["id"]: t for t in json.loads(out)["types"]}


def _struct(btf, name):
    found = [t for t in btf.values() if t["kind"] == "STRUCT" and t["name"] == name]
    assert len(found) == 1, f"struct {name}: {len(found)} in BTF"
    return found[0]


def _size(btf, type_id):
    """Byte size of a BTF type (through typedefs and qualifiers)."""
    t = btf[type_id]
    if t["kind"] in ("TYPEDEF", "VOLATILE", "CONST", "RESTRICT", "TYPE_TAG"):
        return _size(btf, t["type_id"])
    if t["kind"] == "ARRAY":
        return t["nr_elems"] * _size(btf, t["type_id"])
    return t["size"]


def _flat(btf, st, base=0):
    """(name, offset, bytes) of a struct's members, a struct member (the
    record header) by its own members at their place."""
    for m in st["members"]:
        assert m["bits_offset"] % 8 == 0, m            # no bitfields
        t = btf[m["type_id"]]
        if t["kind"] == "STRUCT":
            yield from _flat(btf, t, base + m["bits_offset"] // 8)
        else:
            yield m["name"], base + m["bits_offset"] // 8, _size(btf, m["type_id"])


@pytest.mark.parametrize("cname", list(LAYOUTS))
def test_struct_layout_matches_btf(btf, cname):
    st = _struct(btf, cname)
    dt = LAYOUTS[cname]
    members = list(_flat(btf, st))
    assert dt.names == tuple(m[0] for m in members)    # same fields, same order, none extra
    assert [(n, dt.fields[n][1], dt.fields[n][0].itemsize) for n, _, _ in members] == members
    assert dt.itemsize == st["size"]


def test_known_struct_sizes(btf):
    assert {c: _struct(btf, c)["size"] for c in LAYOUTS} == {
        "nettap_hdr": 24, "nettap_chunk": 504, "nettap_eof": 128, "nettap_log": 72, "nettap_state": 72,
        "nettap_reset": 72, "nettap_owner": 104, "nettap_error": 80, "nettap_destroy": 96,
        "nettap_tls_handshake": 96, "nettap_dlopen": 72, "nettap_retransmit": 80, "nettap_synack_retransmit": 72,
        "nettap_timer": 80, "nettap_probe": 80, "nettap_segment": 96, "nettap_dns": 624,
        "nettap_capture_config": 40, "nettap_probe_counters": 32}


def test_ring_records_are_the_c_structs():
    assert {ring: LAYOUTS[c] for ring, c in R.C_NAMES.items()} == R.RECORDS


@pytest.mark.parametrize("ring", list(R.RECORDS))
def test_ring_slots(ring):
    s = R.stride(R.RECORDS[ring])
    assert s % 8 == 0 and R.SLOTS[ring].itemsize == s
    assert R.SLOTS[ring].fields["rec"][1] == R.RB_HDR


def test_ring_strides():
    # a chunk's stride stays a power of two: its ring holds a whole number of them
    assert {r: R.stride(d) for r, d in R.RECORDS.items()} == {
        "capture_chunks": 512, "capture_eof": 136, "logs": 80, "dlopen": 80, "segments": 104, "dns": 632}
    assert {k: R.stride(d) for k, d in R.DTYPES.items()} == {
        "chunk": 512, "eof": 136, "log": 80, "state": 80, "reset": 80, "owner": 112, "error": 88,
        "destroy": 104, "tls_handshake": 104, "dlopen": 80, "retransmit": 88,
        "synack_retransmit": 80, "timer": 88, "probe": 88, "segment": 104, "dns": 632, "timewait": 88, "request": 88}


# ---- #define constants ----------------------------------------------------

def _defines():
    """NAME -> int for every `#define NETTAP_* <integer expression>` in tcp.h."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    out = {}
    for name, expr in re.findall(r"^#define[ \t]+(NETTAP_\w+)[ \t]+(.+?)[ \t]*$", text, flags=re.M):
        expr = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr)
        if re.fullmatch(r"[0-9()<\s*]+", expr):
            out[name] = eval(expr, {"__builtins__": {}})    # digits, parentheses, << and * only
    return out


DEFINES = _defines()


def _prefixed(prefix):
    return {k[len(prefix):].lower(): v for k, v in DEFINES.items() if k.startswith(prefix)}


def test_header_parsed():
    # every #define of the header but the include guard was read as an integer
    lines = re.findall(r"^#define[ \t]+(\w+)\b(?!\()", HEADER.read_text(), flags=re.M)
    assert sorted(DEFINES) == sorted(n for n in lines if n != "NETTAP_TCP_H")
    assert len(DEFINES) == 115


def test_chunk_sizes():
    assert DEFINES["NETTAP_CHUNK_DATA"] == R.CHUNK_DATA == R.CHUNK["data"].itemsize
    from exporter.config import MAX_PAYLOAD_BYTES
    assert DEFINES["NETTAP_MAX_CHUNKS_PER_CALL"] * DEFINES["NETTAP_CHUNK_DATA"] == MAX_PAYLOAD_BYTES
    from exporter.kernel.tcp_h import MAX_CGROUP_LEVELS
    assert DEFINES["NETTAP_MAX_CGROUP_LEVELS"] == MAX_CGROUP_LEVELS


def test_probes_in_index_order():
    probes = _prefixed("NETTAP_PROBE_")
    count = probes.pop("count")
    assert tuple(sorted(probes, key=probes.get)) == R.PROBES
    assert sorted(probes.values()) == list(range(count)) and count == len(R.PROBES)


def test_rings_in_index_order():
    rings = _prefixed("NETTAP_RING_")
    count = rings.pop("count")
    assert tuple(sorted(rings, key=rings.get)) == R.RINGS
    assert sorted(rings.values()) == list(range(count)) and count == len(R.RINGS)
    assert tuple(R.RING_KINDS) == R.RINGS


def test_kinds_in_number_order():
    kinds = _prefixed("NETTAP_KIND_")
    assert R.NUMBERS == kinds and 0 not in kinds.values()


def test_targets():
    from exporter.kernel import tcp_h
    assert _prefixed("NETTAP_TARGET_") == {"pid": tcp_h.TARGET_PID, "cgroup": tcp_h.TARGET_CGROUP,
                                           "netns": tcp_h.TARGET_NETNS, "port": tcp_h.TARGET_PORT,
                                           "segments": tcp_h.TARGET_SEGMENTS}
    # bit 0 of a target's entry (no kind has 0): the other bits its record kinds
    assert _prefixed("NETTAP_MATCH_") == {"capture": tcp_h.MATCH_CAPTURE} and tcp_h.MATCH_CAPTURE == 1


def test_log_codes():
    assert {v: k for k, v in _prefixed("NETTAP_LOG_").items()} == R.LOG_CODES


def test_chunk_flags():
    flags = _prefixed("NETTAP_CHUNK_F_")
    assert tuple(sorted((v, k) for k, v in flags.items())) == R.CHUNK_FLAGS


def test_directions():
    dirs = _prefixed("NETTAP_DIR_")
    assert tuple(sorted(dirs, key=dirs.get)) == R.DIRECTIONS
    assert sorted(dirs.values()) == [0, 1]
