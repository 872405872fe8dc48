"""exporter/kernel/goelf.py on real Go programs built from tests/go/ by
Debian's Go 1.19 (tests/gobuild.py), each variant a build flag users ship
with: the entries and RETs against binutils (readelf, objdump: independent
ELF readers and disassembler), the itab hash against the itab's bytes, the
offsets table against the DWARF, and each refusal by name on a crafted file.

Run with -s to see how long inspect() takes on each variant."""
import shutil
import subprocess
import time

import pytest

import gobuild
from exporter.kernel import goelf, gotables

WRITE, READ = "crypto/tls.(*Conn).Write", "crypto/tls.(*Conn).Read"
ITAB = "go.itab.*net.TCPConn,net.Conn"
VARIANTS = ["plain", "stripped", "pie", "pie_stripped", "boringcrypto"]


@pytest.fixture(scope="module")
def built():
    ok, why = gobuild.available()
    if not ok:
        pytest.fail(why)            # the set-up installs Go: its absence is a failure, not a skip
    return {v: gobuild.build("gotls", v) for v in VARIANTS}


@pytest.fixture(scope="module")
def inspected(built):
    out = {}
    for v in VARIANTS:
        t = time.perf_counter()
        goelf.inspect(built[v])
        cold = time.perf_counter() - t
        t = time.perf_counter()
        out[v] = goelf.inspect(built[v])
        warm = time.perf_counter() - t
        print("goelf.inspect(%s): %.1f ms, again %.1f ms" % (v, cold * 1e3, warm * 1e3))
        assert warm < 1.0               # the whole DWARF parsed took 1.3 s: only what is needed is read
    return out


def readelf(path: str) -> dict:
    """{symbol: (file offset, size)} of the functions and the itab, by readelf."""
    out = subprocess.run(["readelf", "-W", "-s", "-l", path], capture_output=True, text=True, check=True).stdout
    segs, syms = [], {}
    for f in (line.split() for line in out.splitlines()):
        if f and f[0] == "LOAD":
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
        elif len(f) == 8 and f[7] in (WRITE, READ, ITAB):
            syms[f[7]] = (int(f[1], 16), int(f[2], 0))
    return {n: (a - va + off, size) for n, (a, size) in syms.items()
            for off, va, filesz in segs if va <= a < va + filesz}


def test_each_variant(built, inspected):
    for v, got in inspected.items():
        assert got is not None, v
        assert got.version == "go1.19.8" and got.settings["GOARCH"] == "amd64"
        assert got.path_in_module.endswith("tests/go/gotls")
        assert got.stripped == ("stripped" in v)
        assert (got.settings.get("-ldflags") == "-s -w") == got.stripped
        assert (got.settings.get("GOEXPERIMENT") == "boringcrypto") == (v == "boringcrypto")
        assert got.offsets == goelf.BPF_OFFSETS
        assert got.offsets_from == ("table" if got.stripped else "dwarf")
        data = open(built[v], "rb").read()
        for rets in (got.write_rets, got.read_rets):
            assert len(rets) >= 2 and all(data[r] == 0xC3 for r in rets), (v, rets)
        assert got.write_entry < got.write_rets[0] and got.read_entry < got.read_rets[0]


def test_stripped_builds_give_the_same_probe_points(inspected):
    points = lambda g: (g.write_entry, g.read_entry, g.write_rets, g.read_rets)
    assert points(inspected["plain"]) == points(inspected["stripped"])
    assert points(inspected["pie"]) == points(inspected["pie_stripped"])
    assert len({g.conn_type_hash for g in inspected.values()}) == 1


@pytest.mark.skipif(not shutil.which("objdump"), reason="binutils' objdump")
def test_entries_and_rets_are_binutils(built, inspected, tmp_path):
    for v in ("plain", "pie", "boringcrypto"):
        syms, got = readelf(built[v]), inspected[v]
        assert (syms[WRITE][0], syms[READ][0]) == (got.write_entry, got.read_entry)
        data = open(built[v], "rb").read()
        itab = syms[ITAB][0]
        assert got.conn_type_hash == int.from_bytes(data[itab + 16:itab + 20], "little")
        for name, rets, entry in ((WRITE, got.write_rets, got.write_entry), (READ, got.read_rets, got.read_entry)):
            # objdump disassembles the function's own bytes (a copy at offset 0: addresses are offsets)
            (tmp_path / "code").write_bytes(data[entry:entry + syms[name][1]])
            out = subprocess.run(["objdump", "-D", "-b", "binary", "-m", "i386:x86-64", "--adjust-vma=%d" % entry,
                                  str(tmp_path / "code")], capture_output=True, text=True, check=True).stdout
            want = tuple(int(f.split(":")[0], 16) for f in out.splitlines() if f.rstrip().endswith("\tret"))
            assert rets == want, (v, name)


def test_the_table_is_the_dwarf(built):
    from elftools.elf.elffile import ELFFile
    from exporter.kernel.gotables import Image
    with open(built["plain"], "rb") as f:
        assert goelf.dwarf_offsets(Image(f, ELFFile(f), f.name)) == goelf.GO_OFFSETS["1.19"]


def test_programs_without_crypto_tls_or_go(tmp_path):
    assert goelf.inspect(gobuild.build("notls")) is None
    assert goelf.inspect("/bin/true") is None
    (tmp_path / "text").write_text("not a program\n")
    refused(str(tmp_path / "text"), "not_elf")


def test_another_machines_program_is_refused(built, tmp_path):
    """The plain build with its ELF header's e_machine saying arm64 (EM_AARCH64, 183), read on
    x86-64: refused by name (test_goelf_arm64.py reads real arm64 builds)."""
    data = bytearray(open(built["plain"], "rb").read())
    assert data[18:20] == (62).to_bytes(2, "little")          # EM_X86_64
    data[18:20] = (183).to_bytes(2, "little")
    (tmp_path / "arm64").write_bytes(bytes(data))
    refused(str(tmp_path / "arm64"), "go_arch", "EM_AARCH64")


def test_every_refusal_has_a_listed_reason():
    import re
    from pathlib import Path
    src = "".join(Path(m.__file__).read_text() for m in (goelf, gotables))
    raised = set(re.findall(r'Refused\("(\w+)"', src))
    assert raised == set(goelf.REASONS)


def refused(path, reason, *words):
    with pytest.raises(goelf.Refused) as e:
        goelf.inspect(path)
    assert e.value.reason == reason and path in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def patched(src, dst, old: bytes, new: bytes, count=1):
    data = open(src, "rb").read()
    assert data.count(old) == count, (old, data.count(old))
    dst.write_bytes(data.replace(old, new))
    return str(dst)


def section_offset(path, name):
    out = subprocess.run(["readelf", "-W", "-S", path], capture_output=True, text=True, check=True).stdout
    return next(int(f.split()[-7], 16) for f in out.splitlines() if " %s " % name in f)


def test_crafted_files_are_refused_by_name(built, tmp_path):
    src = built["stripped"]
    data = open(src, "rb").read()
    pcln = section_offset(src, ".gopclntab")
    assert data[pcln:pcln + 4] == b"\xf0\xff\xff\xff"
    for magic, reason, word in ((b"\xfa\xff\xff\xff", "go_version", "Go 1.16/1.17"),
                                (b"\x78\x56\x34\x12", "go_symbols", "0x12345678")):
        (tmp_path / "magic").write_bytes(data[:pcln] + magic + data[pcln + 4:])
        refused(str(tmp_path / "magic"), reason, word)
    (tmp_path / "cut").write_bytes(data[:pcln + 64])
    refused(str(tmp_path / "cut"), "go_symbols", "cut short")
    # build info with pointers to the strings, as before Go 1.18 (here pointing nowhere)
    info = section_offset(src, ".go.buildinfo")
    (tmp_path / "old").write_bytes(data[:info + 15] + bytes([data[info + 15] & ~2]) + data[info + 16:])
    refused(str(tmp_path / "old"), "go_version", "Go 1.18+")
    # the version in the build info: Go 1.16 (stack ABI); Go 1.18 without DWARF (not in the table)
    refused(patched(src, tmp_path / "v16", b"\x08go1.19.8", b"\x08go1.16.8"), "go_version", "go1.16.8")
    refused(patched(src, tmp_path / "v18", b"\x08go1.19.8", b"\x08go1.18.8"), "go_layout", "go1.18.8", "1.19")
    # a second function spelled crypto/tls.(*Conn).Write in the pclntab
    refused(patched(src, tmp_path / "dup", b"\0crypto/tls.(*Conn).Close\0", b"\0crypto/tls.(*Conn).Write\0"),
            "go_symbols", WRITE, "2 times")
    # no type named *net.TCPConn (the name is stored as "*net.TCPConn" with tflagExtraStar)
    refused(patched(src, tmp_path / "itab", b"\x0c*net.TCPConn", b"\x0c*net.TCPConX"), "go_itab", "*net.TCPConn")
    # Read with its RETs overwritten by int3
    got = goelf.inspect(src)
    noret = bytearray(data)
    for r in got.read_rets:
        noret[r] = 0xCC
    (tmp_path / "noret").write_bytes(bytes(noret))
    refused(str(tmp_path / "noret"), "go_symbols", "no RET", READ)
    # Write's prologue is not the register ABI's stack check
    entry = got.write_entry
    (tmp_path / "abi").write_bytes(data[:entry] + b"\x90" * 4 + data[entry + 4:])
    refused(str(tmp_path / "abi"), "go_version", WRITE, "R14")


def test_a_pie_whose_pointers_are_only_relocations(built, inspected, tmp_path):
    """A PIE's linker may leave its pointer words 0 and put the addresses in R_X86_64_RELATIVE
    addends only: with the itablink and the pclntab's textStart zeroed, the same is found."""
    src = built["pie_stripped"]
    data = bytearray(open(src, "rb").read())
    pcln = section_offset(src, ".data.rel.ro.gopclntab")
    links = section_offset(src, ".data.rel.ro.itablink")
    size = int(next(f.split()[-6] for f in subprocess.run(["readelf", "-W", "-S", src], capture_output=True,
                                                          text=True).stdout.splitlines() if "itablink" in f), 16)
    data[pcln + 24:pcln + 32] = bytes(8)
    data[links:links + size] = bytes(size)
    (tmp_path / "pie").write_bytes(bytes(data))
    assert goelf.inspect(str(tmp_path / "pie")) == inspected["pie_stripped"]
