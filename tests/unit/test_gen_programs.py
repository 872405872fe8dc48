"""The program table (scripts/gen_programs.py, run by gen_layout.py): fresh,
and a tag naming what user space does not know fails the build."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from exporter.kernel import arch

ROOT = Path(__file__).resolve().parents[2]
OBJ = arch.object_path("tcp.bpf.o", bpf_dir=str(ROOT / "bpf"))
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("gen_layout", ROOT / "scripts" / "gen_layout.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
import gen_programs  # noqa: E402  (scripts/, on the path above)


def _consts():
    return gen.defines((ROOT / "bpf" / "tcp.h").read_text())


def test_generated_files_are_fresh(tmp_path):
    outs = ("tcp_h.py", "records.md", "records.schema.json", "programs_h.py", "capture.md")
    assert gen.main([OBJ, str(ROOT / "bpf" / "tcp.h")] + [str(tmp_path / o) for o in outs]) == 0
    for made, committed in zip(outs[3:], ("exporter/kernel/programs_h.py", "docs/capture.md")):
        assert (tmp_path / made).read_text() == (ROOT / committed).read_text(), \
            f"{committed} is stale: run make -C bpf and commit it"


def test_every_program_of_the_object_is_in_the_table():
    table = gen_programs.programs(OBJ, _consts(), gen.btf_types(OBJ))
    assert set(table) == set(gen_programs.elf_programs(OBJ)) and len(table) > 90
    assert table["tcp_sendmsg_exit"][5][-1] == ("syscalls", "sys_exit_sendmsg") and table["tcp_sendmsg_exit"][6]
    assert table["tcp_sk_error"][3] == "sock:inet_sk_error_report"


def _broken(tag_of: str, text: str | None):
    """The object's BTF with tcp_rst_sent's tag replaced by text (None: removed)."""
    types = gen.btf_types(OBJ)
    func = next(i for i, t in types.items() if t["kind"] == "FUNC" and t["name"] == tag_of)
    tag = next(i for i, t in types.items() if t["kind"] == "DECL_TAG" and t["type_id"] == func)
    if text is None:
        del types[tag]
    else:
        types[tag] = dict(types[tag], name="prog:" + text)
    return types


@pytest.mark.parametrize("text,why", [
    ("probe=tcp_stat mech=tp_btf", "unknown probe 'tcp_stat'"),
    ("probe=tcp_state mech=fprobe", "unknown mechanism 'fprobe'"),
    ("probe=tcp_state mech=kprobe", "mechanism kprobe but SEC tp_btf/tcp_send_reset"),
    ("probe=tcp_state mech=tp_btf needs=sock:tcp_send_reset", "unknown feature 'sock:tcp_send_reset'"),
    ("probe=tcp_state mech=tp_btf variant=slow", "unknown variant 'slow'"),
    ("probe=tcp_state mech=tp_btf atach=x", "needs probe= and mech="),
    ("probe=tcp_state mech=tp_btf lib=go", "on uprobe programs"),
    ("probe=tcp_state mech=tp_btf records=reset,resets", "unknown record kind 'resets'"),
    (None, "has no NETTAP_PROG tag"),
])
def test_a_wrong_tag_fails_the_build(text, why):
    with pytest.raises(SystemExit, match=why):
        gen_programs.programs(OBJ, _consts(), _broken("tcp_rst_sent", text))


def test_a_uprobe_names_its_library_and_go_returns_are_at_ret():
    table = gen_programs.programs(OBJ, _consts(), gen.btf_types(OBJ))
    assert table["go_tls_read_ret"][5:] == (("crypto/tls.(*Conn).Read",), True, "go", ())
    assert table["go_tls_read_enter"][5:] == (("crypto/tls.(*Conn).Read",), False, "go", ())
    assert table["ssl_read_exit"][7] == "openssl" and table["tcp_rst_sent"][7] == ""
    with pytest.raises(SystemExit, match="lib='boringssl'"):
        gen_programs.programs(OBJ, _consts(), _broken("ssl_free", "probe=ssl_read mech=uprobe lib=boringssl"))


def test_the_routes_follow_from_the_mechanisms():
    """What exporter/kernel/programs.py derives from the table: which probes
    are planned, fixed or TLS's, and the returns attached first."""
    from exporter.kernel import programs, tcp_h
    assert programs.planned() == ["tcp_sendmsg", "tcp_recvmsg", "dns"]
    assert programs.uprobe() == ["ssl_write", "ssl_read", "ssl_handshake"]
    assert programs.uprobe("go") == ["go_tls_write", "go_tls_read"]
    assert "tcp_state" in programs.fixed() and "tcp_accept" in programs.fixed()
    assert set(tcp_h.PROBES) <= set(programs.probes())        # every counted probe has programs
    for probe in programs.probes():
        for mech in programs.mechanisms(probe):
            for variant in ("fast", "compat"):
                names = programs.names(probe, mech, variant)
                rets = [programs.is_return(n) for n in names]
                assert names and rets == sorted(rets, reverse=True), (probe, mech, variant)
    assert programs.functions("dns") == ["inet_sendmsg", "inet6_sendmsg", "inet_recvmsg", "inet6_recvmsg"]
    assert programs.returns_on("dns") == "inet_recvmsg"


@pytest.mark.parametrize("text", ["map:variant=slow", "map:prealloc=never", "map:prealloc_max=lots", "map:size=1"])
def test_a_wrong_map_tag_fails_the_build(text):
    types = gen.btf_types(OBJ)
    tag = next(i for i, t in types.items() if t["kind"] == "DECL_TAG" and t["name"].startswith("map:"))
    assert gen_programs.maps(types)
    types[tag] = dict(types[tag], name=text)
    with pytest.raises(SystemExit, match="gen_layout: map "):
        gen_programs.maps(types)


def test_a_probe_runs_for_the_record_kinds_its_programs_name():
    """The records= tags, as the loader asks them (programs.records): a probe
    all of whose programs name kinds runs for those; one with an untagged
    program (tcp_state: it decides capture) always."""
    from exporter.kernel import programs
    assert programs.records("tcp_timer") == {"timer", "probe"}
    assert programs.records("tcp_timer_exit") == {"probe"}
    assert programs.records("tcp_segment") == {"segment"}
    assert programs.records("tcp_accept") == {"owner"}
    assert programs.records("tcp_state") is None and programs.records("tcp_sendmsg") is None
