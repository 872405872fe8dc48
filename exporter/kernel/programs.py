"""The probes and their programs, as bpf/<arch>/tcp.bpf.o defines them: each
program's NETTAP_PROG tag (bpf/tcp.h) says the probe it serves, its
mechanism, its variant, the kernel feature it needs and what it attaches to;
scripts/gen_layout.py writes them into programs_h.py. The loader, the
mechanism planner, dns.py and tls.py ask this module, never a list of names
of their own (docs/architecture.md#adding-a-probe).

A probe's route follows from its programs' mechanisms: a probe with programs
in every one of PLANNED gets one of them chosen per kernel
(mechanisms.plan); one with uprobe programs is TLS's (tls.py); one with a
single mechanism of FIXED is attached as its SEC or its tag says.
"""
from __future__ import annotations

from exporter.kernel.programs_h import PROGRAMS

PLANNED = ("fentry", "kprobe", "tracepoint")     # in the design card's order of preference
FIXED = ("tp_btf", "tracepoint")
UPROBE = "uprobe"
LIBS = ("openssl", "go")        # whose calls uprobe programs are on (their lib= tag)
PROBES, MECH, VARIANT, NEEDS, SECTION, ATTACH, RETURN, LIB, RECORDS = range(9)     # a PROGRAMS row's fields


def probes() -> list:
    """Every probe, in the object's order of its first program."""
    return list(dict.fromkeys(p for row in PROGRAMS.values() for p in row[PROBES]))


def mechanisms(probe: str) -> tuple:
    """The mechanisms a probe has programs in, in the object's order."""
    return tuple(dict.fromkeys(row[MECH] for row in PROGRAMS.values() if probe in row[PROBES]))


def planned() -> list:
    """The probes whose mechanism is chosen per kernel (mechanisms.plan)."""
    return [p for p in probes() if set(PLANNED) <= set(mechanisms(p))]


def fixed() -> list:
    """The probes of one fixed mechanism (tp_btf, or tracepoints user space
    attaches): the lifecycle programs (loader.py)."""
    return [p for p in probes() if len(mechanisms(p)) == 1 and mechanisms(p)[0] in FIXED]


def uprobe(lib: str = "openssl") -> list:
    """The probes of uprobe programs on a library's calls (TLS: tls.py for
    OpenSSL's libssl, gotls.py for Go's crypto/tls)."""
    return [p for p in probes() if any(row[MECH] == UPROBE and row[LIB] == lib for row in PROGRAMS.values()
                                       if p in row[PROBES])]


def names(probe: str, mechanism: str | None = None, variant: str = "fast", only: bool = False) -> list:
    """The programs of a probe (of one mechanism, unless None) that load in
    a variant (theirs, or both), the returns first: attached in this order,
    no call can enter captured and return before its return program is there
    (its state would go stale). only: the programs serving this probe alone."""
    rows = [(n, row) for n, row in PROGRAMS.items() if probe in row[PROBES]
            and (mechanism is None or row[MECH] == mechanism) and row[VARIANT] in ("", variant)
            and (not only or len(row[PROBES]) == 1)]
    return [n for n, row in rows if row[RETURN]] + [n for n, row in rows if not row[RETURN]]


def records(probe: str) -> frozenset | None:
    """The record kinds a probe's programs run for (their records= tags):
    attached while capture.records asks for one of them; None: always."""
    kinds = [row[RECORDS] for row in PROGRAMS.values() if probe in row[PROBES]]
    return None if not kinds or not all(kinds) else frozenset(k for ks in kinds for k in ks)


def needs(probe: str) -> str:
    """The kernel feature (features.py) a probe's programs need, or ''."""
    return next((row[NEEDS] for row in PROGRAMS.values() if probe in row[PROBES] and row[NEEDS]), "")


def attach(name: str) -> tuple:
    """What a program attaches to: (category, tracepoint) pairs for a
    tracepoint program, symbols for a uprobe, else its SEC's target."""
    return PROGRAMS[name.removesuffix("_compat") if name not in PROGRAMS else name][ATTACH]


def functions(probe: str, mechanism: str = "fentry") -> list:
    """The kernel functions a probe's programs of a mechanism attach to."""
    return list(dict.fromkeys(a for n, row in PROGRAMS.items() if probe in row[PROBES] and row[MECH] == mechanism
                              for a in row[ATTACH]))


def returns_on(probe: str, mechanism: str = "fentry") -> str:
    """The function the probe's first return program (fexit) attaches to."""
    return next(row[ATTACH][0] for row in PROGRAMS.values()
                if probe in row[PROBES] and row[MECH] == mechanism and row[RETURN])


def is_return(name: str) -> bool:
    return PROGRAMS[name][RETURN]


def tracepoints() -> dict:
    """program -> the tracepoints user space attaches it to, every
    tracepoint program's (scripts/hold_tracepoints.py holds them all)."""
    return {n: row[ATTACH] for n, row in PROGRAMS.items() if row[SECTION].startswith("tracepoint/")}
