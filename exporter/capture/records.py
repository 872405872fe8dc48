"""Ring records: the layouts of bpf/tcp.h (numpy's, built at first use) and their JSON lines.

Each dtype is built from exporter/kernel/tcp_h.py, which scripts/gen_layout.py
generates from the BTF of ``bpf/<arch>/tcp.bpf.o``: names, offsets and sizes are the C
structs' own, and a record's kind (its struct's NETTAP_RECORD tag) is the
number in its header's ``kind`` (NETTAP_KIND_*), so a ring may carry several.
:data:`SLOTS` wraps each in the 8-byte ring-buffer record header
(``struct bpf_ringbuf_hdr``: u32 len with the BUSY and DISCARD bits, u32
pg_off) and pads it to its stride: the layout of ring memory, which the tests
build rings from.

:func:`jsonl` turns a batch into JSON lines (keys in byte order, the payload
in base64 so binary and non-UTF-8 bytes survive) with the compiled writer
(``exporter/capture/writer.c``, built by ``pip install``): one call for the
batch, without the interpreter lock. It is the only writer nettap ships; the
pure-Python one it is checked against is a test oracle (tests/oracles.py).
"""
from __future__ import annotations

import errno
import json
import socket

from exporter.kernel import tcp_h
from exporter.kernel.tcp_h import CHUNK_DATA, PROBES, RINGS  # noqa: F401

DIRECTIONS = tuple(tcp_h.NAMES["DIR"].get(i) for i in range(max(tcp_h.NAMES["DIR"]) + 1))
CHUNK_FLAGS = tuple(tcp_h.NAMES["CHUNK_F"].items())
LOG_CODES = tcp_h.NAMES["LOG"]
AF_NAMES = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6"}
# The kernel's TCP states (include/net/tcp_states.h), the NETTAP_JSON form enum:tcp_state.
TCP_STATES = ("", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT",
              "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING", "NEW_SYN_RECV", "BOUND_INACTIVE")

# Linux's error numbers (include/uapi/asm-generic/errno*.h), the NETTAP_JSON form enum:errno.
ERRNO_NAMES = dict(sorted(errno.errorcode.items()))

# kernel/bpf/ringbuf.c: BPF_RINGBUF_BUSY_BIT, BPF_RINGBUF_DISCARD_BIT, BPF_RINGBUF_HDR_SZ
RB_BUSY = 1 << 31
RB_DISCARD = 1 << 30
RB_HDR = 8

_SCALARS = {"__u64": "<u8", "__u32": "<u4", "__u16": "<u2", "__u8": "u1", "char": "S1"}


def u64_fields(struct: str) -> tuple:
    """The field names of a struct of bpf/tcp.h made of __u64s only (a per-CPU
    counter row, read without numpy: exporter.kernel.maps.PerCpuArray)."""
    _size, fields = tcp_h.STRUCTS[struct]
    if any(f[2] != "__u64" or f[3] != 1 for f in fields):
        raise TypeError(f"struct {struct} is not made of __u64s only")
    return tuple(f[0] for f in fields)


PROBE_COUNTER_FIELDS = u64_fields("nettap_probe_counters")
# Where in the header every record starts with is the kind.
KIND_FIELD = next((off, nbytes) for name, off, _, _, nbytes, *_ in tcp_h.STRUCTS["nettap_hdr"][1] if name == "kind")
# kind -> its number (NETTAP_KIND_*); ring -> the kinds it carries.
NUMBERS = {kind: n for n, kind in tcp_h.NAMES["KIND"].items()}
RING_KINDS = {ring: tuple(k for k, (r, _) in tcp_h.RECORDS.items() if r == ring) for ring in RINGS}
# ring -> the scan's mask of the kinds it accepts there (bit n: kind number n).
MASKS = {ring: sum(1 << NUMBERS[k] for k in kinds) for ring, kinds in RING_KINDS.items()}
# The rings that carry one kind (all of them today), by that kind: its name
# (the JSON "type"), struct and number (the writer's and the scan's), and the
# bytes one record takes in ring memory (ring header + record, 8-aligned).
_ONE = {ring: kinds[0] for ring, kinds in RING_KINDS.items() if len(kinds) == 1}
KIND_NAMES = dict(_ONE)
C_NAMES = {ring: tcp_h.RECORDS[kind][1] for ring, kind in _ONE.items()}
KINDS = {ring: NUMBERS[kind] for ring, kind in _ONE.items()}
STRIDES = {ring: tcp_h.STRIDES[kind] for ring, kind in _ONE.items()}


# ---- the numpy layouts: built at first use ----------------------------------
# numpy costs ~15 MB of RSS and ~45 ms of start: an idle nettap (nothing
# captured, only scraped) never imports it. These names are built on first
# access (PEP 562): a copied batch (the logs, dns and dlopen rings), the
# decoder of `nettap read`, the tests.
_LAYOUTS = ("CAPTURE_CONFIG", "PROBE_COUNTERS", "HEADER", "DTYPES", "RECORDS", "CHUNK", "EOF_", "LOG", "SLOTS")


def dtype_of(struct: str, structs: dict = tcp_h.STRUCTS):
    """The numpy layout of a struct of bpf/tcp.h (``structs``: tcp_h.STRUCTS,
    or an earlier revision's). Byte arrays read as text (a char array, an
    address) are S: numpy strips their trailing NULs; the rest (a payload)
    are V, raw bytes."""
    import numpy as np
    size, fields = structs[struct]
    formats = []
    for _name, _off, ctype, count, nbytes, form, _ in fields:
        if count == 1:
            formats.append(_SCALARS[ctype])
        elif ctype == "char" or form == "addr":
            formats.append(f"S{count}")
        else:
            formats.append(f"V{nbytes}")
    return np.dtype({"names": [f[0] for f in fields], "formats": formats,
                     "offsets": [f[1] for f in fields], "itemsize": size})


def stride(record) -> int:
    """Bytes one record (a numpy dtype) takes in ring memory: header + record, 8-aligned."""
    return (RB_HDR + record.itemsize + 7) & ~7


def slot_dtype(record):
    """Ring header + record + padding, as laid out in ring memory."""
    import numpy as np
    return np.dtype({"names": ["rb_len", "rb_pg_off", "rec"],
                     "formats": ["<u4", "<u4", record],
                     "offsets": [0, 4, RB_HDR], "itemsize": stride(record)})


def _layouts() -> dict:
    dtypes = {kind: dtype_of(struct) for kind, (_, struct) in tcp_h.RECORDS.items()}
    recs = {ring: dtypes[kind] for ring, kind in _ONE.items()}
    slots = {ring: slot_dtype(rec) for ring, rec in recs.items()}
    assert all(slots[r].itemsize == STRIDES[r] for r in _ONE), "tcp_h.STRIDES disagrees with the dtypes"
    return {"CAPTURE_CONFIG": dtype_of("nettap_capture_config"), "PROBE_COUNTERS": dtype_of("nettap_probe_counters"),
            "HEADER": dtype_of("nettap_hdr"), "DTYPES": dtypes, "RECORDS": recs, "CHUNK": recs["capture_chunks"],
            "EOF_": recs["capture_eof"], "LOG": recs["logs"], "SLOTS": slots}


def _layout(name: str):
    if name not in globals():
        globals().update(_layouts())
    return globals()[name]


def __getattr__(name: str):
    if name in _LAYOUTS:
        return _layout(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the compiled writer (exporter/capture/writer.c) ----------------------------

def _quoted(names: dict) -> list:
    """An enum table for init(): item v is value v's name as a quoted JSON
    string, or None where the writer prints the number."""
    return [json.dumps(names[v]).encode() if names.get(v) else None for v in range(max(names) + 1)]


def names_of(form: str) -> dict:
    """value -> name for an enum: or flags: JSON form (docs/records.md)."""
    group = form.split(":", 1)[1]
    if group == "tcp_state":
        return {i: n for i, n in enumerate(TCP_STATES) if n}
    if group == "errno":
        return ERRNO_NAMES
    return tcp_h.NAMES[group[len("NETTAP_"):]]


def _writer_tables():
    """init()'s arguments, from the field tables of exporter/kernel/tcp_h.py:
    the enum and flag tables; per kind number (None where no kind has it) its
    size and its rows, one per JSON key in byte order (the text before the
    value, then where the field is and how it is written); and where a
    record's header holds its kind (offset, bytes). The rows' op numbers
    are the module's (its OPS, by JSON form, and OP_LIT: exporter/capture/jsonl.h)."""
    from exporter.capture import _jsonl
    enums, flags = {}, {}
    kinds = [None] * (max(NUMBERS.values()) + 1)
    for kind, (_ring, struct) in tcp_h.RECORDS.items():
        size, fields = tcp_h.STRUCTS[struct]
        by_name = {f[0]: f for f in fields}
        keyed = sorted([f for f in fields if f[5] not in ("-", "kind")] + [("type",)], key=lambda f: f[0].encode())
        rows = []
        for i, f in enumerate(keyed):
            lead = "{" if i == 0 else ","
            if f[0] == "type":
                rows.append((f'{lead}"type":"{kind}"'.encode(), _jsonl.OP_LIT, 0, 0, 0, 0))
                continue
            name, off, _ctype, _count, nbytes, form = f[:6]
            op, arg, arg_width = _jsonl.OPS[form.split(":", 1)[0]], 0, 0
            if form == "addr":
                arg, arg_width = by_name["family"][1], by_name["family"][4]
            elif form.startswith("enum:"):
                arg = enums.setdefault(form, len(enums))
            elif form.startswith("flags:"):
                arg = flags.setdefault(form, len(flags))
            elif form.startswith("base64:"):
                length = by_name[form.split(":", 1)[1]]
                arg, arg_width = length[1], length[4]
            rows.append((f"{lead}{json.dumps(name)}:".encode(), op, off, nbytes, arg, arg_width))
        kinds[NUMBERS[kind]] = (size, rows)
    enum_tables = [_quoted(names_of(form)) for form in enums]
    flag_tables = [[(bit, json.dumps(n).encode()) for bit, n in names_of(form).items()] for form in flags]
    return enum_tables, flag_tables, kinds, KIND_FIELD


def _load_compiled():
    """The compiled writer, given its tables. A missing or stale build is an
    ImportError that says so: nettap has no other writer."""
    try:
        from exporter.capture import _jsonl
    except ImportError as e:
        raise ImportError(f"exporter.capture._jsonl is not built ({e}): run scripts/setup.sh, "
                          "or pip install . with gcc and python3-dev present") from None
    if not hasattr(_jsonl, "OPS") or "kind_field" not in (_jsonl.init.__doc__ or ""):
        raise ImportError("exporter.capture._jsonl is stale: rebuild it (scripts/setup.sh)")
    _jsonl.init(*_writer_tables())
    return _jsonl


compiled = _load_compiled()
KINDS_MAX = compiled.KINDS_MAX      # kind numbers 0 to KINDS_MAX - 1: the mask's bits and the scan's counts
# ring -> the longest line one of its records can give, newline included
# (every field at its widest, every comm byte escaped, a full payload), as the
# compiled writer bounds it, rounded up to 512: the pipeline bounds its queue
# by these before formatting. tests/unit/test_jsonl.py checks the writer's
# bounds against extreme records.
LINE_MAX = {ring: -(-max(compiled.line_max(NUMBERS[k]) for k in kinds) // 512) * 512
            for ring, kinds in RING_KINDS.items()}


def kind_of(name: str) -> str:
    """A record kind, by its name or by the name of a ring that carries only it."""
    if name in NUMBERS:
        return name
    if name in _ONE:
        return _ONE[name]
    raise KeyError(f"{name!r} is neither a record kind nor a ring of one kind")


def jsonl(name: str, recs) -> bytes:
    """Every record's JSON line, each ended by a newline, as UTF-8 bytes (what
    a sink writes), in one call without the interpreter lock. name: the
    records' kind, or their ring's when it carries one kind."""
    kind = kind_of(name)
    if recs.dtype != _layout("DTYPES")[kind]:       # the writer checks the item size only
        raise TypeError(f"{name}: records of dtype {recs.dtype}, not the {kind} kind's")
    return compiled.format(NUMBERS[kind], recs)
