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
from exporter.kernel import tcp_h

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_layout", ROOT / "scripts" / "gen_layout.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_generated_files_are_fresh(tmp_path):
    assert gen.main([str(ROOT / "bpf" / "tcp.bpf.o"), str(ROOT / "bpf" / "tcp.h"),
                     str(tmp_path / "tcp_h.py"), str(tmp_path / "records.md")]) == 0
    for made, committed in (("tcp_h.py", "exporter/kernel/tcp_h.py"), ("records.md", "docs/records.md")):
        assert (tmp_path / made).read_text() == (ROOT / committed).read_text(), \
            f"{committed} is stale: run make -C bpf and commit it"


def test_kinds_agree_in_sequence():
    rings = [ring for ring, _ in tcp_h.RECORDS.values()]
    assert rings == list(tcp_h.RINGS) == list(R.RECORDS) == list(R.KINDS)
    assert [R.KINDS[r] for r in rings] == list(range(len(rings)))          # init()'s kind order
    assert list(R.KIND_NAMES.values()) == list(tcp_h.RECORDS)
    sections = re.findall(r"^## `(\w+)`$", (ROOT / "docs" / "records.md").read_text(), flags=re.M)
    assert sections == list(tcp_h.RECORDS)


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
