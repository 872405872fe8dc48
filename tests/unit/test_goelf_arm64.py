"""exporter/kernel/goelf.py on arm64 Go programs, cross-built from tests/go/ by
Debian's Go 1.19 (tests/gobuild.py, GOARCH=arm64): read as the arm64 machine
would (machine="aarch64"), the entries and RETs against binutils' aarch64
readelf and objdump, the offsets against the DWARF; and refused, by name, on a
machine whose objects are another architecture's."""
import re
import shutil
import subprocess

import pytest

import gobuild
from exporter.kernel import goelf
from unit.test_goelf import READ, WRITE, readelf, refused

# The variants the unit tests build for arm64: one cross-compiled standard library between them
# (gobuild.PREBUILT); a PIE or BoringCrypto build would cross-compile another.
ARM64_VARIANTS = ["plain", "stripped"]
RET = bytes.fromhex("c0035fd6")         # ret (x30), little-endian
OBJDUMP = "aarch64-linux-gnu-objdump"


@pytest.fixture(scope="module")
def built():
    ok, why = gobuild.available()
    if not ok:
        pytest.fail(why)
    return {v: gobuild.build("gotls", v, "arm64") for v in ARM64_VARIANTS}


@pytest.fixture(scope="module")
def inspected(built):
    return {v: goelf.inspect(built[v], machine="aarch64") for v in ARM64_VARIANTS}


def test_each_arm64_variant(built, inspected):
    for v, got in inspected.items():
        assert got is not None, v
        assert got.version == "go1.19.8" and got.settings["GOARCH"] == "arm64"
        assert got.stripped == (v == "stripped")
        assert got.offsets == goelf.BPF_OFFSETS
        assert got.offsets_from == ("table" if got.stripped else "dwarf")
        data = open(built[v], "rb").read()
        for entry, rets in ((got.write_entry, got.write_rets), (got.read_entry, got.read_rets)):
            assert len(rets) >= 2 and all(data[r:r + 4] == RET for r in rets), (v, rets)
            assert entry < rets[0] and entry % 4 == 0
            # the entry is the stack check through g (R28): ldr x16, [x28, #0x10]
            assert data[entry:entry + 4] == bytes.fromhex("900b40f9"), (v, data[entry:entry + 4].hex())
    points = lambda g: (g.write_entry, g.read_entry, g.write_rets, g.read_rets, g.conn_type_hash)
    assert points(inspected["plain"]) == points(inspected["stripped"])


@pytest.mark.skipif(not shutil.which(OBJDUMP), reason="binutils-aarch64-linux-gnu's objdump")
def test_arm64_entries_and_rets_are_binutils(built, inspected, tmp_path):
    syms, got = readelf(built["plain"]), inspected["plain"]
    assert (syms[WRITE][0], syms[READ][0]) == (got.write_entry, got.read_entry)
    data = open(built["plain"], "rb").read()
    itab = syms["go.itab.*net.TCPConn,net.Conn"][0]
    assert got.conn_type_hash == int.from_bytes(data[itab + 16:itab + 20], "little")
    for name, rets, entry in ((WRITE, got.write_rets, got.write_entry), (READ, got.read_rets, got.read_entry)):
        (tmp_path / "code").write_bytes(data[entry:entry + syms[name][1]])
        out = subprocess.run([OBJDUMP, "-D", "-b", "binary", "-m", "aarch64", "--adjust-vma=%d" % entry,
                              str(tmp_path / "code")], capture_output=True, text=True, check=True).stdout
        want = tuple(int(f.split(":")[0], 16) for f in out.splitlines() if re.search(r"\tret\b", f))
        assert rets == want, name


def test_the_table_is_the_arm64_dwarf(built):
    from elftools.elf.elffile import ELFFile
    from exporter.kernel.gotables import Image
    with open(built["plain"], "rb") as f:
        assert goelf.dwarf_offsets(Image(f, ELFFile(f), f.name)) == goelf.GO_OFFSETS["1.19"]


def test_a_program_of_another_architecture_is_refused_by_name(built):
    """Each machine's objects read only its own architecture's programs: an arm64 program
    on x86-64, an x86-64 program on arm64."""
    with pytest.raises(goelf.Refused) as e:
        goelf.inspect(built["plain"], machine="x86_64")
    assert e.value.reason == "go_arch" and "EM_AARCH64" in str(e.value) and "x86's" in str(e.value)
    amd64 = gobuild.build("gotls", "plain", "amd64")
    with pytest.raises(goelf.Refused) as e:
        goelf.inspect(amd64, machine="aarch64")
    assert e.value.reason == "go_arch" and "EM_X86_64" in str(e.value) and "arm64's" in str(e.value)


def test_an_arm64_entry_without_the_stack_check_is_refused(built, inspected, tmp_path):
    data = open(built["stripped"], "rb").read()
    entry = inspected["stripped"].write_entry
    (tmp_path / "abi").write_bytes(data[:entry] + bytes.fromhex("1f2003d5") + data[entry + 4:])    # nop
    with pytest.raises(goelf.Refused) as e:
        goelf.inspect(str(tmp_path / "abi"), machine="aarch64")
    assert e.value.reason == "go_version" and WRITE in str(e.value) and "R28" in str(e.value)


def test_by_default_this_machines_objects_decide(built):
    """goelf.inspect's default machine is this one's: on x86-64 the arm64 program is refused."""
    import platform
    if platform.machine() == "x86_64":
        refused(built["plain"], "go_arch", "EM_AARCH64")
