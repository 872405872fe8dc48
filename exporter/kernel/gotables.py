"""The runtime tables of a Go executable that locate functions and itabs
without running it: ``.symtab`` where the binary has one, else the
``pclntab`` every Go binary keeps (``-ldflags='-s -w'`` drops only the ELF
symbols and DWARF), and the ``itablink`` list of the itabs.

pyelftools reads the ELF structure (header, sections, program headers);
the Go tables are read here, the way the Go runtime reads them
(runtime/symtab.go, runtime/type.go, runtime/iface.go). The symbol table's
fixed 24-byte ``Elf64_Sym`` records are unpacked with ``struct`` because
pyelftools' symbol objects take 0.37 s for the ~7000 symbols of a small Go
program, ``struct.iter_unpack`` 9 ms.
"""
from __future__ import annotations

import struct

ELF64_SYM = struct.Struct("<IBBHQQ")        # st_name, st_info, st_other, st_shndx, st_value, st_size
STT_FUNC, STT_OBJECT = 2, 1
R_RELATIVE = {"EM_X86_64": 8, "EM_AARCH64": 1027}    # R_X86_64_RELATIVE, R_AARCH64_RELATIVE

# runtime/symtab.go pcHeader.magic: the layout of the pclntab, one per toolchain range
# (debug/gosym/pclntab.go names them the same way)
PCLN_GO118 = 0xFFFFFFF0                     # Go 1.18, 1.19
PCLN_GO120 = 0xFFFFFFF1                     # Go 1.20+: same header and functab layout as 1.18
PCLN_OLD = {0xFFFFFFFA: "Go 1.16/1.17", 0xFFFFFFFB: "Go 1.2-1.15"}
PCLN_HEADER = struct.Struct("<IBBBB8Q")     # magic, pad1, pad2, minLC, ptrSize, nfunc, nfiles,
#                                             textStart, funcnameOffset, cuOffset, filetabOffset,
#                                             pctabOffset, pclnOffset

# runtime/type.go _type (internal/abi.Type from 1.21; the same layout from Go 1.14 on):
# size 0, ptrdata 8, hash 16, tflag 20, align 21, fieldAlign 22, kind 23, equal 24, gcdata 32,
# str 40 (a nameOff from the module's types base), ptrToThis 44
TYPE_TFLAG, TYPE_STR = 20, 40
TFLAG_EXTRA_STAR = 2                        # the name is stored with a leading '*' to drop
# runtime/runtime2.go itab: inter 0, _type 8, hash 16 (a copy of _type.hash), fun 24
ITAB_INTER, ITAB_TYPE, ITAB_HASH = 0, 8, 16
MAX_FUNC = 64 << 10


# Refused.reason, each a label value of the refusals nettap counts
REASONS = ("go_version", "go_arch", "go_layout", "go_itab", "go_symbols", "not_elf")


class Refused(Exception):
    """A Go TLS program nettap cannot probe: ``reason`` is a short snake_case
    id (the label of a refusal), ``str()`` a sentence naming the file's problem."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Image:
    """The file of an executable as its loader maps it: virtual addresses to
    file offsets through the ``PT_LOAD`` segments, reads by address."""

    def __init__(self, f, elf, name: str):
        self.f, self.elf, self.name = f, elf, name
        self.loads = [(s["p_vaddr"], s["p_filesz"], s["p_offset"]) for s in elf.iter_segments()
                      if s["p_type"] == "PT_LOAD"]
        self.sections = {s.name: s for s in elf.iter_sections()}
        self._relative = None

    def offset(self, va: int) -> int:
        for vaddr, filesz, off in self.loads:
            if vaddr <= va < vaddr + filesz:
                return va - vaddr + off
        raise Refused("go_symbols", "%s: address %#x is in no loaded segment of the file" % (self.name, va))

    def read(self, va: int, n: int) -> bytes:
        self.f.seek(self.offset(va))
        b = self.f.read(n)
        if len(b) != n:
            raise Refused("go_symbols", "%s: %d bytes at %#x run past the file's end" % (self.name, n, va))
        return b

    def u32(self, va: int) -> int:
        return struct.unpack("<I", self.read(va, 4))[0]

    def ptr(self, va: int) -> int:
        """A pointer as loaded: the file's word, or in a PIE whose linker left
        the word 0 the ``R_*_RELATIVE`` relocation's addend (the address
        before the load bias, the same space as the symbols)."""
        v = struct.unpack("<Q", self.read(va, 8))[0]
        if v == 0:
            if self._relative is None:
                self._relative = _relative_addends(self.elf)
            v = self._relative.get(va, 0)
        return v

    def section_data(self, *names):
        for n in names:
            sec = self.sections.get(n)
            if sec is not None and sec["sh_type"] != "SHT_NOBITS":
                data = sec.data()
                if len(data) != sec["sh_size"]:
                    raise Refused("go_symbols", "%s: its %s is cut short (%d of %d bytes)"
                                  % (self.name, n, len(data), sec["sh_size"]))
                return sec, data
        return None, None


def _relative_addends(elf) -> dict:
    out, relative = {}, R_RELATIVE.get(elf["e_machine"])
    for sec in elf.iter_sections():
        if sec["sh_type"] == "SHT_RELA" and sec["sh_entsize"] == 24:
            for r_offset, r_info, r_addend in struct.iter_unpack("<QQq", sec.data()):
                if r_info & 0xFFFFFFFF == relative:
                    out[r_offset] = r_addend
    return out


def _symtab(img: Image):
    sec = img.sections.get(".symtab")
    if sec is None or sec["sh_type"] != "SHT_SYMTAB" or sec["sh_entsize"] != ELF64_SYM.size:
        return None
    strtab = img.elf.get_section(sec["sh_link"]).data()
    return ELF64_SYM.iter_unpack(sec.data()), strtab


def symtab_lookup(img: Image, names: dict):
    """{name: [(value, size), ...]} of the ``.symtab`` symbols named in
    ``names`` (a dict name -> st_info type), or None without a ``.symtab``."""
    tab = _symtab(img)
    if tab is None:
        return None
    syms, strtab = tab
    want = {n.encode() + b"\0": (n, t) for n, t in names.items()}
    out = {n: [] for n in names}
    for st_name, st_info, _other, shndx, value, size in syms:
        if shndx == 0 or strtab[st_name] == 0:
            continue
        end = strtab.find(b"\0", st_name)
        hit = want.get(strtab[st_name:end + 1])
        if hit is not None and st_info & 0xF == hit[1]:
            out[hit[0]].append((value, size))
    return out


def pclntab_functions(img: Image, names) -> dict:
    """{name: [(entry address, size), ...]} from the Go 1.18+ pclntab (runtime/symtab.go
    pcHeader, functab of nfunc+1 {entryoff, funcoff} u32 pairs, _func {entryoff, nameoff});
    the size runs to the next function's entry (its int3 padding included)."""
    sec, d = img.section_data(".gopclntab", ".data.rel.ro.gopclntab")
    if d is None or len(d) < PCLN_HEADER.size:
        raise Refused("go_symbols", "%s: a Go program without .symtab and without a pclntab" % img.name)
    magic, pad1, pad2, _minlc, ptrsize, nfunc, _nf, text, nameoff, _cu, _ft, _pc, pcln = PCLN_HEADER.unpack_from(d)
    if magic in PCLN_OLD:
        raise Refused("go_version", "%s: its pclntab has the %s layout (magic %#x): Go 1.18+ is read"
                      % (img.name, PCLN_OLD[magic], magic))
    if magic not in (PCLN_GO118, PCLN_GO120) or pad1 or pad2 or ptrsize != 8:
        raise Refused("go_symbols", "%s: unknown pclntab header (magic %#x, pointer size %d)"
                      % (img.name, magic, ptrsize))
    if text == 0:                                 # relocated: textStart is an address
        text = img.ptr(sec["sh_addr"] + 8 + 8 * 2)
    funcnames = d[nameoff:pcln]
    wanted = {}                                   # nameoff -> name, every place each name is spelled
    for n in names:
        key, i = n.encode() + b"\0", -1
        while True:
            i = funcnames.find(key, i + 1)
            if i < 0:
                break
            if i == 0 or funcnames[i - 1] == 0:
                wanted[i] = n
    out = {n: [] for n in names}
    ftab = list(struct.iter_unpack("<II", d[pcln:pcln + 8 * (nfunc + 1)]))
    for k in range(nfunc):
        entryoff, funcoff = ftab[k]
        name = wanted.get(struct.unpack_from("<i", d, pcln + funcoff + 4)[0])
        if name is not None:
            out[name].append((text + entryoff, ftab[k + 1][0] - entryoff))
    return out


def functions(img: Image, names) -> dict:
    """{name: (entry address, size)} of Go functions, by ``.symtab`` else the pclntab; a
    name absent is left out; one found twice or larger than 64 KiB is refused."""
    found = symtab_lookup(img, {n: STT_FUNC for n in names})
    if found is None:
        found = pclntab_functions(img, names)
    out = {}
    for n, hits in found.items():
        if len(hits) > 1:
            raise Refused("go_symbols", "%s: function %s is found %d times" % (img.name, n, len(hits)))
        if hits:
            va, size = hits[0]
            if not 0 < size <= MAX_FUNC:
                raise Refused("go_symbols", "%s: function %s is %d bytes (1 to 64 KiB are read)"
                              % (img.name, n, size))
            out[n] = (va, size)
    return out


def uvarint(b: bytes, i: int):
    """(value, next index) of the unsigned varint at ``b[i]`` (encoding/binary)."""
    x = shift = 0
    while True:
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return x, i


def _name(img: Image, types: int, off: int) -> str:
    """A runtime name (runtime/type.go name: a flag byte, a uvarint length from Go 1.17)."""
    n, i = uvarint(img.read(types + off, 8), 1)
    return img.read(types + off + i, n).decode(errors="replace")


def _type_name(img: Image, types: int, t: int) -> str:
    name = _name(img, types, struct.unpack("<i", img.read(t + TYPE_STR, 4))[0])
    return name[1:] if img.read(t + TYPE_TFLAG, 1)[0] & TFLAG_EXTRA_STAR else name


def itab_address(img: Image, concrete: str, iface: str) -> int:
    """The address of the itab of ``concrete`` for ``iface``: its symbol
    (``go.itab.C,I``, ``go:itab.C,I`` from Go 1.20), else the ``itablink`` entry whose
    ``_type`` and ``inter`` carry those names (nameOffs from the types base: the start of
    ``.data.rel.ro`` when the linker used relro, as for a PIE, else of ``.rodata``)."""
    syms = ["go.itab.%s,%s" % (concrete, iface), "go:itab.%s,%s" % (concrete, iface)]
    found = symtab_lookup(img, {s: STT_OBJECT for s in syms})
    if found is not None:
        hits = found[syms[0]] + found[syms[1]]
        if len(hits) == 1:
            return hits[0][0]
        raise Refused("go_itab", "%s: %s symbols for the itab %s,%s"
                      % (img.name, len(hits) or "no", concrete, iface))
    links, data = img.section_data(".itablink", ".data.rel.ro.itablink")
    base = img.sections.get(".data.rel.ro") or img.sections.get(".rodata")
    if links is None or base is None:
        raise Refused("go_itab", "%s: no symbols and no itablink to find the itab %s,%s"
                      % (img.name, concrete, iface))
    types = base["sh_addr"]
    for k in range(len(data) // 8):
        it = img.ptr(links["sh_addr"] + 8 * k)
        if _type_name(img, types, img.ptr(it + ITAB_TYPE)) == concrete \
                and _type_name(img, types, img.ptr(it + ITAB_INTER)) == iface:
            return it
    raise Refused("go_itab", "%s: the itab %s,%s is not in its itablink" % (img.name, concrete, iface))
