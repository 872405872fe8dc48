"""Go's crypto/tls: the uprobes of bpf/gotls.bpf.c on a Go executable's
``crypto/tls.(*Conn).Write`` and ``Read``, attached per file as tls.py's
are on libssl (tlsfiles.py decides which files: those the targets'
processes run).

A Go program carries its TLS inside its executable, so each binary is its
own file to attach: goelf.py reads it (build info, the functions' entries
and RET instructions, the struct offsets and the type hash of
``*net.TCPConn``) and refuses by name what nettap cannot follow. Each probe
gets a program at the function's entry (saves the call per goroutine) and
one at each of its RET instructions (publishes what it moved), the RETs
attached first: no call is entered captured before its RETs are probed.
"""
from __future__ import annotations

import struct

from exporter.kernel import gotables, maps, tcp_h, tls, uprobe_multi
from exporter.kernel import programs as table
from exporter.kernel.objects import destroy_links

# The Go TLS probes and their programs, from the programs' tags (bpf/gotls.bpf.c).
PROBES = tuple(table.uprobe("go"))
ENTRY = {p: n for p in PROBES for n in table.names(p, table.UPROBE) if not table.is_return(n)}
RET = {p: n for p in PROBES for n in table.names(p, table.UPROBE) if table.is_return(n)}
SYMBOL = {p: table.attach(ENTRY[p])[0] for p in PROBES}
# sched_process_exec: a task target ran a program (the dlopen ring)
EXEC = table.names(PROBES[0], "tracepoint")[0]
# fds a Go binary costs, with perf-event uprobes: an event and a link per RET
# (Read has 7, Write 8 in Go 1.19) and per entry; with uprobe_multi: 4 links.
FDS_PER_FILE = {"uprobe": 48, "uprobe_multi": 4}


def programs(variant: str) -> list:
    """Every Go TLS program a variant loads (RETs, entries, the exec tracepoint)."""
    rets = [n for p in PROBES for n in table.names(p, table.UPROBE, variant) if table.is_return(n)]
    return rets + list(ENTRY.values()) + [EXEC]


def _ret(probe: str, variant: str) -> str:
    name = RET[probe]
    return name if variant == "fast" else f"{name}_compat"


def layout(offsets: dict) -> bytes:
    """struct nettap_go_layout (bpf/tcp.h) for map go_tls_layout, from
    goelf.BPF_OFFSETS."""
    size, fields = tcp_h.STRUCTS["nettap_go_layout"]
    values = {**offsets, "itab_hash": gotables.ITAB_HASH}
    buf = bytearray(size)
    for name, off, _ctype, _count, nbytes, *_rest in fields:
        buf[off:off + nbytes] = values[name].to_bytes(nbytes, "little")
    return bytes(buf)


def configure(map_fds: dict, offsets: dict) -> None:
    """Before the first Go file is attached: where a tls.Conn's socket is."""
    maps.update(map_fds["go_tls_layout"], struct.pack("<I", 0), layout(offsets))


def attach_binary(prog, variant: str, path: str, info, mech: str, map_fds: dict) -> tuple:
    """Attach the Go TLS programs to the binary at path, which goelf.inspect
    read as info: (links, uprobes per probe, the error that stopped it or "").
    prog(name): a bpf_program *. Its *net.TCPConn type hash is allowed first."""
    made, counts = [], dict.fromkeys(PROBES, 0)
    sites = {"go_tls_write": (info.write_entry, info.write_rets), "go_tls_read": (info.read_entry, info.read_rets)}
    try:
        maps.update(map_fds["go_conn_types"], struct.pack("<I", info.conn_type_hash), b"\x01")
        for probe in PROBES:
            entry, rets = sites[probe]
            made += _links(prog(_ret(probe, variant)), path, list(rets), mech)
            made += _links(prog(ENTRY[probe]), path, [entry], mech)
            counts[probe] = len(rets) + 1
    except OSError as e:
        return made, counts, str(e)
    return made, counts, ""


def _links(prog: int, path: str, offsets: list, mech: str) -> list:
    """The uprobes of one program at file offsets of path: one uprobe_multi
    link, or a perf-event uprobe per offset (never a uretprobe: see above)."""
    if mech == "uprobe_multi":
        return [uprobe_multi.link(uprobe_multi.prog_fd(prog), path, offsets, False)]
    made = []
    try:
        for off in offsets:
            made.append(tls.attach_uprobe(prog, path, None, False, off))
    except OSError:
        destroy_links(made)
        raise
    return made
