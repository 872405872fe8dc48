"""The TIME_WAIT and request programs run for every timer (or state change)
of the node and say no to all but nettap's at their first compare: each ends
(its first BPF_EXIT, where the JIT puts its epilogue) within its first
instructions, what follows the compare being a subprogram (bpf/timer.bpf.h).
With the exit last of 400-700 instructions a no on a CPU that had been idle
cost ~2.8x an empty program's run (docs/benchmarks.md). Read from the
committed objects' symbol tables (pyelftools)."""
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from exporter.kernel import ksyms

ROOT = Path(__file__).resolve().parents[2]
BPF_EXIT = 0x95                # BPF_JMP | BPF_EXIT: the opcode byte of an 8-byte instruction
FIRST = 20                     # the compare, the call, the exit: 8-17 instructions in the objects


def first_exits(obj: Path) -> dict:
    """program -> (index of its first exit instruction, its instructions)."""
    out = {}
    with open(obj, "rb") as f:
        elf = ELFFile(f)
        for sym in elf.get_section_by_name(".symtab").iter_symbols():
            if sym.name not in ksyms.PROGRAMS or sym["st_info"]["type"] != "STT_FUNC":
                continue
            start = sym["st_value"]
            code = elf.get_section(sym["st_shndx"]).data()[start:start + sym["st_size"]]
            opcodes = code[0::8]
            out[sym.name] = (opcodes.index(BPF_EXIT) if BPF_EXIT in opcodes else None, len(opcodes))
    return out


@pytest.mark.parametrize("arch", ["x86", "arm64"])
def test_each_timer_program_says_no_within_its_first_instructions(arch):
    exits = first_exits(ROOT / "bpf" / arch / "tcp.bpf.o")
    assert set(exits) == set(ksyms.PROGRAMS)
    for name, (first, n) in exits.items():
        assert first is not None and first < FIRST, (name, first, n)
