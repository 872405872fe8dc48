#!/usr/bin/env python3
"""bpf/tcp.h for user space: exporter/kernel/tcp_h.py, docs/records.md and
docs/records.schema.json (the lines' JSON Schema),
generated from the header's #defines and the BTF of the compiled object (its
structs, and the NETTAP_JSON / NETTAP_RECORD decl tags on them), as bpf2go
derives Go types from BTF. Nothing about a record kind is written twice by
hand: the numpy layouts, the kind and constant names, each field's JSON form
and the field tables of the docs all come from here. With PROGRAMS_OUT and
CAPTURE_DOC, also the program table (exporter/kernel/programs_h.py) from the
programs' NETTAP_PROG tags and SEC names, and docs/capture.md's probe table.

  scripts/gen_layout.py OBJECT HEADER PYTHON_OUT DOCS_OUT SCHEMA_OUT [PROGRAMS_OUT CAPTURE_DOC]

Run by `make -C bpf` after the object is built; `make -C bpf check` runs it
into a scratch directory and fails when the committed files are stale. Needs
bpftool (its JSON dump of the object's BTF) and the standard library only.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

# JSON forms a field may be given (NETTAP_JSON); a field without one is a number.
FORMS = {
    "-": "left out of the line (padding)",
    "kind": "the record's kind (`NETTAP_KIND_*`), written as the key `type` with the kind's name",
    "family": "the address family's name (`ipv4`, `ipv6`), else its number as a string",
    "addr": "an address of the record's family, in its text form (IPv4 from the first 4 bytes)",
    "text": "a task name: the bytes up to the first NUL, invalid UTF-8 replaced by U+FFFD",
    "enum:GROUP": "the value's name from the GROUP of #defines, else its number, as a string",
    "enum:tcp_state": "the kernel's TCP state name (`ESTABLISHED`, ...), else its number, as a string",
    "enum:errno": "the error number's name (`ECONNREFUSED`, ...), else its number, as a string",
    "flags:GROUP": "a list of the set bits' names from GROUP; unknown bits as one hex string",
    "base64:FIELD": "the first FIELD bytes (at most the array's size), in base64",
}
HEADER = "nettap_hdr"       # the struct every ring record starts with
CAPTURE_DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "capture.md")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
_INT = re.compile(r"^#define[ \t]+NETTAP_(\w+)[ \t]+(.+?)[ \t]*$", re.M)


def _bpftool() -> str:
    for p in (shutil.which("bpftool"), "/usr/sbin/bpftool", "/usr/bin/bpftool"):
        if p:
            return p
    raise SystemExit("gen_layout: bpftool not found")


def defines(header: str) -> dict:
    """NAME -> int for every `#define NETTAP_NAME <integer expression>`."""
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    out = {}
    for name, expr in _INT.findall(text):
        expr = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr)
        if re.fullmatch(r"[0-9()<\s*]+", expr):
            out[name] = eval(expr, {"__builtins__": {}})    # digits, parentheses, << and * only
    return out


def define_notes(header: str) -> dict:
    """NAME -> the trailing comment of `#define NETTAP_NAME value /* ... */`."""
    return {n: re.sub(r"\s*\n\s*\*?\s*", " ", c).strip()
            for n, c in re.findall(r"^#define[ \t]+NETTAP_(\w+)[ \t]+[^/\n]+/\*(.*?)\*/", header, flags=re.M | re.S)}


def comments(header: str) -> dict:
    """(struct, field) -> the field's trailing comment, joined over its lines."""
    out = {}
    for struct, body in re.findall(r"struct\s+(?:NETTAP_RECORD\([^)]*\)\s+)?(nettap_\w+)\s*\{(.*?)\n\}[^;\n]*;",
                                   header, flags=re.S):
        for field, text in re.findall(r"\s(\w+)(?:\[\w+\])?(?:\s+NETTAP_JSON\([^)]*\))?;[ \t]*/\*(.*?)\*/",
                                      body, flags=re.S):
            out[(struct, field)] = re.sub(r"\s*\n\s*\*?\s*", " ", text).strip()
    return out


def _named(types: dict, tid: int):
    """(C type name as written, element count, byte size) of a member's type."""
    t = types[tid]
    if t["kind"] == "ARRAY":
        name, _, size = _named(types, t["type_id"])
        return name, t["nr_elems"], size * t["nr_elems"]
    if t["kind"] == "TYPEDEF":
        return t["name"], 1, _named(types, t["type_id"])[2]
    if t["kind"] in ("INT", "ENUM"):
        return t["name"], 1, t["size"]
    raise SystemExit(f"gen_layout: a member of type {t['kind']} {t.get('name')!r}: not a plain field")


def btf_types(obj: str) -> dict:
    """id -> type of the object's BTF (bpftool's JSON dump)."""
    return {t["id"]: t for t in json.loads(subprocess.run(
        [_bpftool(), "-j", "btf", "dump", "file", obj], check=True, capture_output=True, timeout=60).stdout)["types"]}


def layout(obj: str, header: str) -> dict:
    types = btf_types(obj)
    declared = re.findall(r"^struct\s+(?:NETTAP_RECORD\([^)]*\)\s+)?(nettap_\w+)\s*\{", header, flags=re.M)
    tags = {}
    for t in types.values():
        if t["kind"] == "DECL_TAG":
            tags.setdefault(t["type_id"], {})[t["component_idx"]] = t["name"]
    notes = comments(header)
    structs, records, parts = {}, {}, set()

    def members(t, base: int):
        """A struct's fields; a member that is itself a struct (the record
        header, a socket's ports and addresses) gives its own fields, at
        their place in the outer one, each with its own comment unless the
        member's comment says what it means here ("sport: ...; dport: ...")."""
        own = tags.get(t["id"], {})
        for i, m in enumerate(t["members"]):
            if m["bits_offset"] % 8:
                raise SystemExit(f"gen_layout: {t['name']}.{m['name']} is a bitfield")
            inner = types[m["type_id"]]
            if inner["kind"] == "STRUCT":
                parts.add(inner["name"])
                said = dict(p.split(": ", 1) for p in notes.get((t["name"], m["name"]), "").split("; ") if ": " in p)
                fields = list(members(inner, base + m["bits_offset"] // 8))
                if set(said) - {f[0] for f in fields}:
                    raise SystemExit(f"gen_layout: {t['name']}.{m['name']}'s comment names no field of it: "
                                     f"{sorted(set(said) - {f[0] for f in fields})}")
                yield from (f[:6] + (said.get(f[0], f[6]),) for f in fields)
                continue
            ctype, count, size = _named(types, m["type_id"])
            form = own.get(i, "json:")[len("json:"):]
            yield (m["name"], base + m["bits_offset"] // 8, ctype, count, size, form,
                   notes.get((t["name"], m["name"]), ""))

    for t in types.values():
        if t["kind"] != "STRUCT" or t["name"] not in declared:
            continue
        fields = tuple(members(t, 0))
        names = [f[0] for f in fields]
        if len(set(names)) != len(names):
            raise SystemExit(f"gen_layout: {t['name']}: a field name given twice (one is the header's?)")
        structs[t["name"]] = (t["size"], fields)
        own = tags.get(t["id"], {})
        if -1 in own:
            _, kind, ring = own[-1].split(":")
            records[kind] = (ring, t["name"])
    missing = set(declared) - set(structs)
    if missing:
        raise SystemExit(f"gen_layout: not in the object's BTF (unused by every program?): {sorted(missing)}")
    for name in parts - {HEADER}:       # a record's part (its socket): in the records, flattened
        del structs[name]
    for name, (_size, fields) in structs.items():
        hole(name, fields)
    return {"structs": structs, "records": records}


def hole(name: str, fields) -> None:
    """Refuse padding the compiler put between two fields (a nested part
    misplaced, an alignment): padding is written out, so that a program
    zeroes it and the layout says where it is."""
    at = 0
    for f in fields:
        if f[1] != at:
            raise SystemExit(f"gen_layout: {name}: {f[1] - at} bytes of padding before {f[0]}: write them out")
        at = f[1] + f[4]


def _groups(consts: dict, structs: dict) -> dict:
    """The groups of #defines that name values: those a field's JSON form
    refers to, and those with a _COUNT (indexes of maps and labels)."""
    want = {g[:-len("_COUNT")] for g in consts if g.endswith("_COUNT")}
    want |= {"KIND"} if any(k.startswith("KIND_") for k in consts) else set()
    for _, fields in structs.values():
        for f in fields:
            if f[5].startswith(("enum:", "flags:")) and f[5].split(":", 1)[1].startswith("NETTAP_"):
                want.add(f[5].split(":", 1)[1][len("NETTAP_"):])
    out = {}
    for g in sorted(want):
        members = [(v, k[len(g) + 1:].lower()) for k, v in consts.items()
                   if k.startswith(g + "_") and k != g + "_COUNT"]
        names = dict(members)
        if not names:
            raise SystemExit(f"gen_layout: no #define NETTAP_{g}_*")
        if len(names) != len(members):
            raise SystemExit(f"gen_layout: NETTAP_{g}_*: two names for one value")
        out[g] = dict(sorted(names.items()))
    return out


def kinds(consts: dict, lay: dict) -> list:
    """The record kinds in the order of their numbers, checked: every
    NETTAP_RECORD kind has its NETTAP_KIND_<KIND>, every NETTAP_KIND_ names a
    record struct, and every record starts with the header."""
    numbers = {k[len("KIND_"):].lower(): v for k, v in consts.items() if k.startswith("KIND_")}
    records, structs = lay["records"], lay["structs"]
    if set(numbers) != set(records):
        raise SystemExit(f"gen_layout: NETTAP_KIND_* {sorted(numbers)} and the NETTAP_RECORD kinds "
                         f"{sorted(records)} differ")
    if 0 in numbers.values() or len(set(numbers.values())) != len(numbers):
        raise SystemExit("gen_layout: NETTAP_KIND_* must be distinct and not 0")
    head = [f[:5] for f in structs[HEADER][1]]
    for _ring, sname in records.values():
        if [f[:5] for f in structs[sname][1][:len(head)]] != head:
            raise SystemExit(f"gen_layout: struct {sname} does not start with struct {HEADER}")
    return sorted(numbers, key=numbers.get)


def python(consts: dict, lay: dict) -> str:
    structs, records = lay["structs"], lay["records"]
    groups = _groups(consts, structs)
    out = ['"""bpf/tcp.h for user space. GENERATED by scripts/gen_layout.py from the',
           "header's #defines and the BTF of bpf/<arch>/tcp.bpf.o (its structs and their",
           "NETTAP_JSON / NETTAP_RECORD tags): do not edit. `make -C bpf` writes it,",
           "`make -C bpf check` fails when it is stale. Plain values, no numpy: the",
           'config, the targets and the loader import it before numpy is."""', "",
           "# Every `#define NETTAP_<NAME> <integer>` of bpf/tcp.h, as <NAME>."]
    out += [f"{k} = {v}" for k, v in consts.items()]
    out += ["", "# The #defines that name values, by group: NETTAP_<GROUP>_<NAME> -> {value: name}.",
            "NAMES = {"]
    out += [f"    {g!r}: {names!r}," for g, names in groups.items()]
    out += ["}"]
    for g in sorted(g for g in groups if g + "_COUNT" in consts):
        names = groups[g]
        if sorted(names) != list(range(consts[g + "_COUNT"])):
            raise SystemExit(f"gen_layout: NETTAP_{g}_* are not 0..NETTAP_{g}_COUNT-1")
        out.append(f"{g}S = {tuple(names.values())!r}")
    for g in sorted(k[:-len("_ROWS")] for k in consts if k.endswith("_ROWS")):
        starts = sorted((v, k[len(g) + 1:].lower()) for k, v in consts.items()
                        if k.startswith(g + "_") and k != g + "_ROWS")
        ends = [v for v, _ in starts[1:]] + [consts[g + "_ROWS"]]
        out += [f"{g}_BLOCKS = " + repr({n: (v, e) for (v, n), e in zip(starts, ends)})
                + f"    # rows NETTAP_{g}_*: name -> (first, end)"]
    out += ["", "# Every struct of bpf/tcp.h: name -> (size, fields); a field is",
            "# (name, offset, C type, elements, bytes, JSON form, comment); nested parts flattened.",
            "STRUCTS = {"]
    for name, (size, fields) in structs.items():
        out.append(f"    {name!r}: ({size}, (")
        out += [f"        {f!r}," for f in fields]
        out.append("    )),")
    out += ["}", "", "# Ring record kinds (NETTAP_RECORD), by kind number (NETTAP_KIND_*):",
            "# kind -> (ring, struct).", "RECORDS = {"]
    by_number = kinds(consts, lay)
    out += [f"    {k!r}: {records[k]!r}," for k in by_number]
    out += ["}", "# Bytes a record of each kind takes in ring memory: the 8-byte ring header",
            "# and the record, 8-aligned.",
            "STRIDES = {" + ", ".join(f"{k!r}: {(8 + structs[records[k][1]][0] + 7) & ~7}" for k in by_number) + "}",
            ""]
    return "\n".join(out)


def _rows(fields) -> list:
    """A field table's rows, by JSON key in byte order (the kind is `type`)."""
    keyed = [("type" if f[5] == "kind" else f[0],) + tuple(f[1:]) for f in fields if f[5] != "-"]
    out = []
    for name, _off, ctype, count, _b, form, note in sorted(keyed, key=lambda f: f[0].encode()):
        t = ctype + (f"[{count}]" if count > 1 else "")
        out.append(f"| `{name}` | `{t}` | {form or 'number'} | {note} |")
    return out


def docs(consts: dict, lay: dict, header: str) -> str:
    structs, records = lay["structs"], lay["records"]
    groups = _groups(consts, structs)
    out = ["# Records", "",
           "<!-- GENERATED by scripts/gen_layout.py from bpf/tcp.h and bpf/<arch>/tcp.bpf.o: do not edit. -->", "",
           "Every record a ring carries is one struct of `bpf/tcp.h`; its JSON line has the struct's",
           "fields as keys in byte order, plus `\"type\"`, the record's kind. A field's JSON form",
           "follows from its C type (an integer is a number) or from its `NETTAP_JSON` tag.",
           "How a kind is added: [architecture.md](architecture.md#adding-a-record-kind).", "",
           "[records.schema.json](records.schema.json) is the same contract as JSON Schema (draft 2020-12),",
           "generated with this page: a consumer in any language can check a line against it (every key",
           "required and no other, each value of its form and within its C type's range);",
           "`tests/unit/test_records_schema.py` checks every golden line against it.", ""]
    numbers = {k[len("KIND_"):].lower(): v for k, v in consts.items() if k.startswith("KIND_")}
    hsize, hfields = structs[HEADER]
    out += ["## The header", "",
            f"Every record starts with `struct {HEADER}` ({hsize} bytes): its fields are in every line.", "",
            "| key | C type | JSON | meaning |", "|---|---|---|---|"]
    out += _rows(hfields)
    out.append("")
    for kind in kinds(consts, lay):
        ring, sname = records[kind]
        size, fields = structs[sname]
        out += [f"## `{kind}`", "",
                f"Kind {numbers[kind]}, ring `{ring}`, `struct {sname}` ({size} bytes).", "",
                "| key | C type | JSON | meaning |", "|---|---|---|---|"]
        out += _rows(fields)
        out += [f"| `{k}` | | text | {d}; only where known |" for k, d in sorted(ADDED_KEYS.get(kind, {}).items())]
        out.append("")
    out += ["## JSON forms", "", "| form | written as |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in FORMS.items()]
    out += ["", "## Named values", ""]
    notes = define_notes(header)
    for g, names in groups.items():
        out += [f"`NETTAP_{g}_*`:", ""]
        out += [f"- {v} `{n}`" + (f": {notes[g + '_' + n.upper()]}" if g + "_" + n.upper() in notes else "")
                for v, n in names.items()]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


_NAMED = {"type": "string", "pattern": "^([A-Z][A-Z0-9_]*|[0-9]+)$"}    # a kernel name, else the number


def _value(form: str, count: int, nbytes: int, groups: dict) -> dict:
    """The JSON Schema of one field, by its JSON form (FORMS)."""
    head, _, arg = form.partition(":")
    number = {"type": "string", "pattern": "^[0-9]+$"}
    if not form:
        return {"type": "integer", "minimum": 0, "maximum": (1 << 8 * nbytes) - 1}
    if head == "family":
        return {"anyOf": [{"enum": ["ipv4", "ipv6"]}, number]}
    if head == "addr":          # IPv4 or IPv6 text; the 16 bytes in hex for another family
        return {"type": "string", "pattern": "^([0-9.]+|[0-9a-f:.]+|[0-9a-f]{32})$"}
    if head == "text":          # each byte at most one character (U+FFFD for a byte of bad UTF-8)
        return {"type": "string", "maxLength": count}
    if head in ("enum", "flags") and not arg.startswith("NETTAP_"):
        return _NAMED
    names = sorted(groups[arg[len("NETTAP_"):]].values()) if head in ("enum", "flags") else []
    if head == "enum":
        return {"anyOf": [{"enum": names}, number]}
    if head == "flags":         # each known bit by its name, then the unknown ones as one hex number
        return {"type": "array", "uniqueItems": True,
                "items": {"anyOf": [{"enum": names}, {"type": "string", "pattern": "^0x[0-9a-f]+$"}]}}
    if head == "base64":
        return {"type": "string", "contentEncoding": "base64", "maxLength": -(-nbytes // 3) * 4,
                "pattern": "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"}
    raise SystemExit(f"gen_layout: no JSON Schema for the form {form!r}")


# Keys user space adds to a kind's line, where it knows them (not in the struct: optional).
ADDED_KEYS = {"owner": {
    "container": "the owner's container's name (the kubelet's pod list; docs/kubernetes.md)",
    "container_id": "the owner's container's id (64 hex digits), from its cgroup's path",
    "namespace": "the owner's pod's namespace (the kubelet's pod list)",
    "pod": "the owner's pod's name (the kubelet's pod list)",
    "pod_uid": "the owner's pod's UID, from its cgroup's path"}}


def schema(consts: dict, lay: dict) -> str:
    """docs/records.schema.json: a JSON line of each kind, as JSON Schema
    (draft 2020-12): every key required, no other, each value of its form."""
    structs, records = lay["structs"], lay["records"]
    groups = _groups(consts, structs)
    defs = {}
    for kind in kinds(consts, lay):
        fields = [f for f in structs[records[kind][1]][1] if f[5] not in ("-", "kind")]
        props = {"type": {"const": kind}}
        props.update((f[0], {"description": f[6], **_value(f[5], f[3], f[4], groups)} if f[6]
                      else _value(f[5], f[3], f[4], groups)) for f in sorted(fields, key=lambda f: f[0].encode()))
        required = sorted(props, key=str.encode)
        props.update((k, {"description": d, "type": "string", "maxLength": 253})
                     for k, d in sorted(ADDED_KEYS.get(kind, {}).items()))
        defs[kind] = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           "title": "nettap records",
           "description": "One JSON line of a nettap capture file, by its \"type\" (docs/records.md). GENERATED by "
                          "scripts/gen_layout.py from bpf/tcp.h and bpf/<arch>/tcp.bpf.o: do not edit.",
           "type": "object",
           "required": ["type"],
           "properties": {"type": {"enum": list(defs)}},
           "allOf": [{"if": {"properties": {"type": {"const": k}}}, "then": {"$ref": f"#/$defs/{k}"}} for k in defs],
           "$defs": defs}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main(argv) -> int:
    if len(argv) not in (5, 7):
        print(__doc__, file=sys.stderr)
        return 2
    obj, header_path, py_out, docs_out, schema_out = argv[:5]
    with open(header_path) as f:
        header = f.read()
    consts = defines(header)
    lay = layout(obj, header)
    outs = [(py_out, python(consts, lay)), (docs_out, docs(consts, lay, header)), (schema_out, schema(consts, lay))]
    if len(argv) == 7:
        import gen_programs         # scripts/, beside this file
        types = btf_types(obj)
        table = gen_programs.programs(obj, consts, types)
        with open(CAPTURE_DOC) as f:
            capture = f.read()
        outs += [(argv[5], gen_programs.python(table, gen_programs.maps(types))),
                 (argv[6], gen_programs.probe_table(table, capture))]
    for path, text in outs:
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
