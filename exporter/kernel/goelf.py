"""What nettap must know about a Go executable before it puts uprobes on its
``crypto/tls.(*Conn).Write`` and ``Read``, read from the file alone:
the Go version and build settings (``.go.buildinfo``), the functions'
entries and every RET instruction in them (return probes: Go moves goroutine
stacks, so no uretprobes), proof of the register ABI, the hash of the
``*net.TCPConn`` itab for ``net.Conn``, and the struct offsets from the TLS
conn to the socket's fd (DWARF, else a table per Go version).

pyelftools reads the ELF and DWARF, capstone disassembles (both imported
inside the functions: an idle nettap loads neither); the Go tables are in
gotables.py. Offsets are FILE offsets, as uprobes take them.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

from exporter.kernel import arch
from exporter.kernel.gotables import ITAB_HASH, REASONS, Image, Refused, functions, itab_address, uvarint

__all__ = ["BPF_OFFSETS", "GO_OFFSETS", "REASONS", "GoTls", "Refused", "inspect"]

WRITE, READ = "crypto/tls.(*Conn).Write", "crypto/tls.(*Conn).Read"
BUILDINFO_MAGIC = b"\xff Go buildinf:"
BUILDINFO_INLINE = 2                        # flags bit: version and modinfo inline (Go 1.18+)
MIN_MINOR = 17                              # the register ABI (ABIInternal): Go 1.17+ on amd64

# The Go programs nettap reads, by ELF e_machine: the architecture of the BPF objects that probe
# them (arch.OBJECTS), and the first Go version with the register ABI there (arm64: Go 1.18).
# A program is read only where the running machine's objects are its architecture's.
MACHINES = {"EM_X86_64": ("x86", 17), "EM_AARCH64": ("arm64", 18)}

# The offsets the BPF side reads with (one set for every file: old kernels give it no per-file
# config): conn = crypto/tls.Conn.conn (a net.Conn: itab pointer at +0, data pointer at +8),
# fd = net.TCPConn.conn + net.conn.fd (the *netFD), sysfd = net.netFD.pfd + internal/poll.FD.Sysfd.
BPF_OFFSETS = {"conn": 0, "fd": 0, "sysfd": 16}

# Offsets for binaries without DWARF, by Go minor version. 1.19: read from the DWARF of a
# Debian go1.19.8 build (tests/unit/test_goelf.py checks it against the DWARF on every run).
# A version not listed is refused (go_layout) rather than guessed.
GO_OFFSETS = {
    "1.19": {"conn": 0, "fd": 0, "sysfd": 16},
}

# What --preflight says of the Go programs nettap reads (docs/limits.md#gos-cryptotls says why).
LIMITS = ("Go 1.18+ on x86-64 and arm64 (register ABI), stripped and PIE builds, BoringCrypto; offsets from "
          "DWARF or the table of " + ", ".join(f"go{v}" for v in GO_OFFSETS))

# (struct, member, member's type name) along the chain the BPF side walks
_CHAIN = {
    "conn": [("crypto/tls.Conn", "conn", "net.Conn")],
    "fd": [("net.TCPConn", "conn", "net.conn"), ("net.conn", "fd", "*net.netFD")],
    "sysfd": [("net.netFD", "pfd", "internal/poll.FD"), ("internal/poll.FD", "Sysfd", "int")],
}


class GoTls(NamedTuple):
    version: str                # "go1.19.8"
    settings: dict              # modinfo build settings: {"-ldflags": "-s -w", "CGO_ENABLED": "1", ...}
    path_in_module: str         # the main package's path, or ""
    write_entry: int            # file offsets of crypto/tls.(*Conn).Write and Read
    read_entry: int
    write_rets: tuple           # file offsets of every RET in each
    read_rets: tuple
    conn_type_hash: int         # itab hash of *net.TCPConn for net.Conn
    offsets: dict               # conn, fd, sysfd (see BPF_OFFSETS)
    offsets_from: str           # "dwarf" or "table"
    stripped: bool              # no .symtab


def _unquote(v: str) -> str:
    if v.startswith('"'):
        try:
            return json.loads(v)        # Go's strconv.Quote of these values is valid JSON
        except ValueError:
            return v[1:-1]
    return v


def buildinfo(img: Image):
    """(version, {setting: value}, main package path) from ``.go.buildinfo``
    (debug/buildinfo/buildinfo.go), or None when the file has none (not Go)."""
    sec, d = img.section_data(".go.buildinfo")
    if d is None or not d.startswith(BUILDINFO_MAGIC) or len(d) < 32:
        return None
    if not d[15] & BUILDINFO_INLINE:            # Go 1.13-1.17: pointers to two Go string headers
        try:
            header = img.ptr(sec["sh_addr"] + 16)
            version = img.read(img.ptr(header), min(img.ptr(header + 8), 64)).decode()
        except (Refused, UnicodeDecodeError):
            version = "Go < 1.18"
        raise Refused("go_version", "%s: built by %s: nettap reads Go 1.18+ (whose build info is inline)"
                      % (img.name, version))
    n, i = uvarint(d, 32)
    version = d[i:i + n].decode(errors="replace")
    n, i = uvarint(d, i + n)
    mod = d[i:i + n]
    mod = mod[16:-16].decode(errors="replace") if len(mod) >= 32 else ""   # 16-byte sentinels
    settings, path = {}, ""
    for line in mod.splitlines():
        kind, _, rest = line.partition("\t")
        if kind == "path":
            path = rest
        elif kind == "build":
            key, _, value = rest.partition("=")
            settings[key] = _unquote(value)
    return version, settings, path


def _minor(img: Image, version: str, min_minor: int = MIN_MINOR) -> int:
    m = re.search(r"go1\.(\d+)", version)
    if m is None:
        raise Refused("go_version", "%s: Go version %r not understood" % (img.name, version))
    minor = int(m.group(1))
    if minor < min_minor:
        raise Refused("go_version", "%s: built by %s, before Go 1.%d's register ABI on its architecture"
                      % (img.name, version, min_minor))
    return minor


def _disassembler(target: str = "x86"):
    import capstone                             # lazily: only a Go binary's inspection needs it
    if target == "arm64":                       # capstone 6 renamed CS_ARCH_ARM64 to CS_ARCH_AARCH64
        md = capstone.Cs(getattr(capstone, "CS_ARCH_AARCH64", None) or capstone.CS_ARCH_ARM64,
                         capstone.CS_MODE_ARM)
    else:
        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.skipdata = True                          # Go pads functions with int3 (arm64: 0, udf): go on past them
    return md


def _stack_check(insns, target: str = "x86") -> bool:
    """ABIInternal's prologue compares the stack with g.stackguard0 (g+0x10) through the
    register g lives in (cmd/compile/abi-internal.md). amd64: ``cmp rsp, [r14+0x10]`` or ``lea
    r12, [rsp-N]; cmp r12, [r14+0x10]``; R14 holds g only under the register ABI. arm64: ``ldr
    x16, [x28, #0x10]`` first (then ``cmp sp, x16`` or ``sub x17, sp, #N; cmp x17, x16``); R28
    has held g on every Go version, so there the version (MACHINES) tells the ABI, and this
    that the entry is the function's."""
    if target == "arm64":
        return len(insns) >= 1 and insns[0][2] == "ldr" and re.fullmatch(r"x\d+, \[x28, #0x10\]", insns[0][3])
    guard = "qword ptr [r14 + 0x10]"
    if len(insns) >= 1 and insns[0][2:] == ("cmp", "rsp, " + guard):
        return True
    return (len(insns) >= 2 and insns[0][2] == "lea" and insns[0][3].startswith("r12, [rsp - ")
            and insns[1][2:] == ("cmp", "r12, " + guard))


def rets(img: Image, md, name: str, va: int, size: int, target: str = "x86") -> tuple:
    """The file offsets of every RET of the function at ``va``, after checking its prologue."""
    insns = list(md.disasm_lite(img.read(va, size), va))
    if not _stack_check(insns[:2], target):
        raise Refused("go_version", "%s: %s does not begin with the register ABI's stack check "
                      "through g (%s; Go 1.17+ ABIInternal)" % (img.name, name, "R28" if target == "arm64" else "R14"))
    # every return: Go emits a bare ret (amd64: 0xc3; arm64: RET, to x30); on amd64 a prefixed
    # one ("repz ret") or "ret imm16" returns too and gets its probe at its first byte
    out = tuple(img.offset(a) for a, _n, mnemonic, _ops in insns if mnemonic.split()[-1] == "ret")
    if not out:
        raise Refused("go_symbols", "%s: no RET instruction found in %s" % (img.name, name))
    return out


def _struct_die(dwarf, data: bytes, name: str):
    """The DW_TAG_structure_type DIE named ``name``: its name is an inline string right after
    the DIE's one-byte abbreviation code (cmd/link/internal/dwarf abbrevs), so the bytes are
    searched and each candidate parsed by pyelftools, instead of parsing all ~15000 type DIEs."""
    key, i = name.encode() + b"\0", 0
    while True:
        i = data.find(key, i + 1)
        if i < 0:
            return None
        try:
            die = dwarf.get_DIE_from_refaddr(i - 1)
        except Exception:                       # not a DIE start: go on searching
            continue
        a = die.attributes.get("DW_AT_name")
        if die.tag == "DW_TAG_structure_type" and a is not None and a.value == key[:-1]:
            return die


def _member(img, dwarf, data, cache, struct_name, member, type_name) -> int:
    die = cache.get(struct_name) or cache.setdefault(struct_name, _struct_die(dwarf, data, struct_name))
    if die is None:
        raise Refused("go_layout", "%s: its DWARF has no struct %s" % (img.name, struct_name))
    for c in die.iter_children():
        a = c.attributes
        if c.tag == "DW_TAG_member" and a.get("DW_AT_name") and a["DW_AT_name"].value == member.encode():
            t = c.get_DIE_from_attribute("DW_AT_type").attributes.get("DW_AT_name")
            loc = a.get("DW_AT_data_member_location")
            if t is None or t.value != type_name.encode() or loc is None or not isinstance(loc.value, int):
                raise Refused("go_layout", "%s: DWARF: %s.%s is not a %s at a constant offset"
                              % (img.name, struct_name, member, type_name))
            return loc.value
    raise Refused("go_layout", "%s: DWARF: struct %s has no member %s" % (img.name, struct_name, member))


def dwarf_offsets(img: Image):
    """The offsets of BPF_OFFSETS read from the binary's DWARF, or None without DWARF."""
    if ".debug_info" not in img.sections and ".zdebug_info" not in img.sections:
        return None
    dwarf = img.elf.get_dwarf_info(relocate_dwarf_sections=False)
    data = dwarf.debug_info_sec.stream.getvalue()
    cache = {}
    return {k: sum(_member(img, dwarf, data, cache, *step) for step in chain) for k, chain in _CHAIN.items()}


def _offsets(img: Image, minor: int, version: str):
    offsets, source = dwarf_offsets(img), "dwarf"
    if offsets is None:
        offsets, source = GO_OFFSETS.get("1.%d" % minor), "table"
        if offsets is None:
            raise Refused("go_layout", "%s: built by %s, without DWARF, and Go 1.%d's struct offsets are "
                          "not in nettap's table (%s)" % (img.name, version, minor, ", ".join(GO_OFFSETS)))
    if offsets != BPF_OFFSETS:
        raise Refused("go_layout", "%s: struct offsets %s (from %s) differ from the ones nettap's BPF "
                      "programs read (%s)" % (img.name, offsets, source, BPF_OFFSETS))
    return dict(offsets), source


def _inspect(img: Image, machine: str | None):
    info = buildinfo(img)
    if info is None:
        return None
    version, settings, path = info
    target, min_minor = MACHINES.get(img.elf["e_machine"], (None, MIN_MINOR))
    minor = _minor(img, version, min_minor)
    if img.elf.elfclass != 64 or not img.elf.little_endian:
        raise Refused("go_arch", "%s: a %d-bit %s program: nettap reads 64-bit little-endian Go programs"
                      % (img.name, img.elf.elfclass, img.elf["e_machine"]))
    funcs = functions(img, [WRITE, READ])
    if WRITE not in funcs or READ not in funcs:
        return None
    here = arch.target(machine)
    if target != here:
        raise Refused("go_arch", "%s: a %s program: nettap's BPF objects here are %s's, which read %s Go "
                      "programs" % (img.name, img.elf["e_machine"], here,
                                    next(m for m, (t, _) in MACHINES.items() if t == here)))
    md = _disassembler(target)
    write_rets, read_rets = (rets(img, md, n, *funcs[n], target) for n in (WRITE, READ))
    itab = itab_address(img, "*net.TCPConn", "net.Conn")
    offsets, source = _offsets(img, minor, version)
    return GoTls(version=version.split()[0], settings=settings, path_in_module=path,
                 write_entry=img.offset(funcs[WRITE][0]), read_entry=img.offset(funcs[READ][0]),
                 write_rets=write_rets, read_rets=read_rets, conn_type_hash=img.u32(itab + ITAB_HASH),
                 offsets=offsets, offsets_from=source, stripped=".symtab" not in img.sections)


def warm() -> None:
    """Import what inspect() reads a file with (pyelftools, capstone), ahead of any file: the TLS
    worker times each file against tls.DEADLINE, and the first Go program's would pay these
    (0.1-0.2 s here, seconds in an emulated guest under load: a CI guest skipped its file once)."""
    import capstone                                      # noqa: F401
    from elftools.elf.elffile import ELFFile             # noqa: F401


def inspect(path: str, machine: str | None = None):
    """A GoTls for the Go program at ``path`` that links crypto/tls, None for a file that is
    not Go or has no crypto/tls; raises Refused for one nettap cannot probe (see the reasons
    in docs/limits.md#gos-cryptotls), or one whose architecture is not machine's (default:
    this one's ``uname -m``; the tests read another's)."""
    from elftools.common.exceptions import ELFError     # lazily, as uprobe_multi.py
    from elftools.elf.elffile import ELFFile
    import struct
    with open(path, "rb") as f:
        try:
            img = Image(f, ELFFile(f), path)
        except ELFError as e:
            raise Refused("not_elf", "%s: not an ELF file (%s)" % (path, e)) from None
        try:
            return _inspect(img, machine)
        except (ELFError, struct.error, IndexError, ValueError) as e:   # UnicodeDecodeError is one
            raise Refused("go_symbols", "%s: a malformed Go table (%s: %s)" % (path, type(e).__name__, e)) from None

