"""One definition per record kind (docs/records.md): bpf/tcp.h is the source,
and what user space knows of it is generated from the compiled object
(scripts/gen_layout.py). The generated files are fresh, and every list of
kinds agrees in sequence: the header's NETTAP_RECORD tags, the Python
layouts, the compiled writer's kinds and the docs' sections."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from exporter.capture import records as R
from exporter.kernel import arch, tcp_h

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_layout", ROOT / "scripts" / "gen_layout.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


GENERATED = (("tcp_h.py", "exporter/kernel/tcp_h.py"), ("records.md", "docs/records.md"),
             ("records.schema.json", "docs/records.schema.json"), ("programs_h.py", "exporter/kernel/programs_h.py"),
             ("capture.md", "docs/capture.md"))


@pytest.mark.parametrize("machine", sorted(arch.OBJECTS))
def test_generated_files_are_fresh_from_every_architectures_object(tmp_path, machine):
    """What is generated is what every architecture's object gives: a record's
    layout, a program's tags, the docs do not depend on the architecture (the
    files are made from x86's, bpf/Makefile)."""
    obj = arch.object_path("tcp.bpf.o", machine, str(ROOT / "bpf"))
    assert gen.main([obj, str(ROOT / "bpf" / "tcp.h")] + [str(tmp_path / made) for made, _ in GENERATED]) == 0
    for made, committed in GENERATED:
        assert (tmp_path / made).read_text() == (ROOT / committed).read_text(), \
            f"{committed} is stale, or differs from {obj}'s: run make -C bpf and commit it"


def test_kinds_agree_in_sequence():
    """The C kind numbers, the Python names and docs/records.md agree, kind
    by kind, in the order of the numbers (a record read as the wrong kind is
    what this prevents)."""
    numbers = tcp_h.NAMES["KIND"]
    assert list(numbers.values()) == list(tcp_h.RECORDS)
    assert R.NUMBERS == {k: n for n, k in numbers.items()}
    assert {ring: R.KINDS[ring] for ring in R.KIND_NAMES} == {r: R.NUMBERS[k] for r, k in R.KIND_NAMES.items()}
    assert set(R.RING_KINDS) == set(tcp_h.RINGS) and all(R.RING_KINDS.values())
    writer = R._writer_tables()[2]
    assert [i for i, k in enumerate(writer) if k] == sorted(numbers)
    assert all(writer[n][0] == tcp_h.STRUCTS[tcp_h.RECORDS[k][1]][0] for n, k in numbers.items())
    sections = re.findall(r"^## `(\w+)`$", (ROOT / "docs" / "records.md").read_text(), flags=re.M)
    assert sections == list(tcp_h.RECORDS)


def test_every_record_starts_with_the_header():
    head = tcp_h.STRUCTS[gen.HEADER][1]
    for kind, (_ring, struct) in tcp_h.RECORDS.items():
        assert tcp_h.STRUCTS[struct][1][:len(head)] == head, kind


def _lay(first_field="ts_ns"):
    hdr = (24, (("ts_ns", 0, "__u64", 1, 8, "", ""), ("conn_id", 8, "__u64", 1, 8, "", ""),
                ("kind", 16, "__u32", 1, 4, "kind", ""), ("pid", 20, "__u32", 1, 4, "", "")))
    rec = (32, ((first_field, 0, "__u64", 1, 8, "", ""),) + hdr[1][1:] + (("x", 24, "__u64", 1, 8, "", ""),))
    return {"structs": {gen.HEADER: hdr, "nettap_a": rec}, "records": {"a": ("ring_a", "nettap_a")}}


@pytest.mark.parametrize("header,lay,why", [
    ("#define NETTAP_KIND_A 1\n#define NETTAP_KIND_B 2\n", _lay(), "NETTAP_KIND_.* and the NETTAP_RECORD kinds"),
    ("", _lay(), "NETTAP_KIND_.* and the NETTAP_RECORD kinds"),
    ("#define NETTAP_KIND_A 0\n", _lay(), "distinct and not 0"),
    ("#define NETTAP_KIND_A 1\n", _lay("when"), "does not start with struct nettap_hdr"),
])
def test_kinds_without_a_number_or_a_header_are_refused(header, lay, why):
    with pytest.raises(SystemExit, match=why):
        gen.kinds(gen.defines(header), lay)


def test_a_nested_members_comment_says_what_its_fields_mean_there():
    """struct nettap_ports ports; /* sport: ... */ gives that record's sport
    its own meaning in docs/records.md; a name that is no field of the
    nested struct is refused, not silently dropped."""
    header = (ROOT / "bpf" / "tcp.h").read_text()
    obj = arch.object_path("tcp.bpf.o", bpf_dir=str(ROOT / "bpf"))
    state = dict((f[0], f[6]) for f in gen.layout(obj, header)["structs"]["nettap_state"][1])
    assert state["sport"] == "local port (0 before it is bound)" and state["dport"] == "remote port"
    assert "/* sport: local port (0 before it is bound) */" in header
    with pytest.raises(SystemExit, match=r"nettap_state.ports's comment names no field of it: \['sprot'\]"):
        gen.layout(obj, header.replace("/* sport: local port (0 before it is bound) */", "/* sprot: x */"))


def test_padding_the_compiler_adds_between_fields_is_refused():
    fields = tcp_h.STRUCTS["nettap_state"][1]
    gen.hole("nettap_state", fields)
    moved = [f if f[0] != "saddr" else f[:1] + (f[1] + 4,) + f[2:] for f in fields]
    with pytest.raises(SystemExit, match="nettap_state: 4 bytes of padding before saddr"):
        gen.hole("nettap_state", moved)


def test_every_json_form_is_known():
    used = {f[5] for _, fields in tcp_h.STRUCTS.values() for f in fields if f[5]}
    generic = {re.sub(r":NETTAP_\w+$", ":GROUP", re.sub(r"^base64:\w+$", "base64:FIELD", u)) for u in used}
    assert generic <= set(gen.FORMS), generic - set(gen.FORMS)


@pytest.mark.parametrize("header,why", [
    ("#define NETTAP_X_A 0\n#define NETTAP_X_B 2\n#define NETTAP_X_COUNT 2\n", "not 0..NETTAP_X_COUNT-1"),
    ("#define NETTAP_X_A 1\n#define NETTAP_X_B 1\n#define NETTAP_X_COUNT 2\n", "two names for one value"),
])
def test_a_group_of_names_that_cannot_be_an_index_is_refused(header, why):
    with pytest.raises(SystemExit, match=why):
        gen.python(gen.defines(header), {"structs": {}, "records": {}})


def test_define_and_field_comments_are_read():
    header = ("#define NETTAP_LOG_A 1 /* first,\n\t\t\t * continued */\n"
              "struct NETTAP_RECORD(\"a\", \"r\") nettap_a {\n\t__u32 x NETTAP_JSON(\"-\"); /* the x */\n};\n")
    assert gen.defines(header) == {"LOG_A": 1}
    assert gen.define_notes(header) == {"LOG_A": "first, continued"}
    assert gen.comments(header) == {("nettap_a", "x"): "the x"}
