"""``nettap read FILE...``: nettap's JSON-lines captures read back.

Lists the captured connections, prints one connection's byte streams in
stream order (text or hex) with what was not captured marked, and writes a
pcap of synthesized TCP segments that Wireshark and tshark follow
(exporter/commands/pcap.py). The files, their records and the connections
and streams made of them are exporter/commands/streams.py's.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Iterator, List

from exporter.util.logsafe import escape
from exporter.util.outpath import open_regular
from exporter.commands.missed import capture_gaps, clock_losses
from exporter.commands.streams import LIFECYCLE, Capture, Conn, Problems, Stream, endpoint, ordered, records, select

# ---- text output ---------------------------------------------------------

def listing(cap: Capture, conns: List[Conn], out) -> None:
    rows = [("CONN", "LOCAL", "REMOTE", "PID", "COMM", "TX", "RX", "TRUNCATED", "GAPS", "CLOSED", "TLS")]
    for c in conns:
        trunc_calls = trunc_bytes = gaps = gap_bytes = 0
        for d, s in c.streams.items():
            trunc_calls += sum(got < n for n, got in s.calls.values())
            for _, n, why in s.holes(c.total(d)):
                if why == "truncated":
                    trunc_bytes += n
                else:
                    gaps, gap_bytes = gaps + 1, gap_bytes + n
        pid = str(c.pid) + (f"+{len(c.pids) - 1}" if len(c.pids) > 1 else "")
        rows.append((str(c.conn_id), endpoint(c.family, c.saddr, c.sport), endpoint(c.family, c.daddr, c.dport),
                     pid, escape(c.comm), str(c.streams["egress"].end(c.total("egress"))),
                     str(c.streams["ingress"].end(c.total("ingress"))),
                     f"{trunc_calls} call{'s' * (trunc_calls > 1)}, {trunc_bytes} B" if trunc_calls else "-",
                     f"{gaps}, {gap_bytes} B" if gaps else "-", "yes" if c.eof else "no",
                     # plaintext bytes sent/received through libssl on its socket
                     f"{c.tls['egress'].end()}/{c.tls['ingress'].end()}" if c.tls else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    n = cap.counts
    life = ", ".join(f"{n[k]} {k}" for k in LIFECYCLE if n[k])
    out.write(f"{len(conns)} connection(s) of {len(cap.conns)}; records: {n['chunk']} chunk, "
              f"{n['eof']} eof, {n['log']} log" + (f", {life}" if life else "")
              + (f", {n['dns']} dns (--dns lists them)" if n["dns"] else "")
              + (f", {n['dlopen']} dlopen" if n["dlopen"] else "") + "\n")
    if any(n > 1 for n in cap.samples):          # capture.sample_connections, from the owner records
        out.write("sampled: " + ", ".join(f"1 in {n} connections ({k} owner record(s))"
                                          for n, k in sorted(cap.samples.items())) + "\n")
    if cap.no_conn:
        out.write(f"{cap.no_conn} chunk(s) without a connection (conn_id 0: nettap's connection table "
                  f"was full): in no stream\n")
    if cap.logs:
        out.write("log records: " + ", ".join(f"{escape(k)} {v}" for k, v in sorted(cap.logs.items())) + "\n")
    for gap in capture_gaps(cap.marks):
        out.write(f"capture gap: {escape(gap)}\n")
    for line in clock_losses(cap.clocks):
        out.write(f"records lost: {line}\n")


def _dns_messages(recs, pids):
    """(record, message, whether whole) of dns records: a UDP record is a
    message; a TCP connection's records are its bytes, cut into messages."""
    from exporter.capture.dns import Stream
    streams = {}
    for r in recs:
        if pids and r["pid"] not in pids:
            continue
        raw = r["data"] if "read_failed" not in r["flags"] else b""     # decoded by streams._check
        if r["transport"] == "tcp":
            s = streams.setdefault((r["sock_ino"], r["direction"]), Stream())
            yield from ((r, m, whole) for m, whole in s.feed(raw, r["size"]))
        else:
            yield r, raw, r["len"] >= r["size"]


def dns_listing(cap: Capture, pids: List[int], out) -> None:
    """Each DNS query of the dns records (capture.dns), in the order sent, with
    its answer: matched as nettap's metrics match them (exporter/capture/dns.py:
    the socket and the id, the first answer within the timeout)."""
    from exporter.capture.dns import TIMEOUT_S, decode
    rows = [("TIME", "PID", "COMM", "SERVER", "NAME", "TYPE", "ANSWER", "RECORDS", "LATENCY")]
    pending, bad, unmatched, t0 = {}, 0, 0, None
    for r, data, complete in _dns_messages(cap.dns, pids):
        try:
            m = decode(data, complete)
        except ValueError:
            bad += 1
            continue
        t0 = r["ts_ns"] if t0 is None else t0
        key = (r["sock_ino"], m.id)
        if not m.response and r["direction"] == "egress":
            row = [f"+{(r['ts_ns'] - t0) / 1e9:.3f}s", str(r["pid"]), escape(r["comm"]),
                   endpoint(r["family"], r["daddr"], r["dport"]), escape(m.name), m.qtype, "no answer", "-", "-"]
            pending[key] = (r["ts_ns"], row)
            rows.append(row)
        elif m.response and r["direction"] == "ingress":
            sent, row = pending.pop(key, (None, None))
            if row is None or r["ts_ns"] - sent > TIMEOUT_S * 1e9:
                unmatched += 1
                continue
            row[6:] = [m.rcode, str(m.answers), f"{(r['ts_ns'] - sent) / 1e6:.3f} ms"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
    out.write(f"{len(rows) - 1} DNS quer{'y' if len(rows) == 2 else 'ies'}"
              + (f"; {unmatched} answer(s) matching no query" if unmatched else "")
              + (f"; {bad} message(s) not DNS or unreadable" if bad else "") + "\n")


def _hole_text(off: int, n: int, why: str, s: Stream) -> str:
    if why == "truncated":
        co = max(o for o in s.calls if o <= off)
        return (f"[nettap: {n} bytes not captured at offset {off}: the call of {s.calls[co][0]} bytes "
                f"at offset {co} was truncated (capture.max_payload_bytes)]")
    if why == "unreadable":
        return f"[nettap: {n} bytes at offset {off} unreadable (the kernel could not read the payload)]"
    return f"[nettap: {n} bytes missing at offset {off} (records lost)]"


_CONTROL = {b: "." for b in range(128) if not 32 <= b < 127 and b not in b"\n\t\r"}
_LONE_CR = re.compile(r"\r(?!\n)")


def _text(data: bytes) -> str:
    """Bytes as text: UTF-8 (U+FFFD where it is not), control characters but
    newline, tab and CR LF as '.', as Wireshark's ASCII view shows them."""
    return _LONE_CR.sub(".", data.decode("utf-8", "replace").translate(_CONTROL))


def _hexdump(off: int, data: bytes) -> Iterator[str]:
    for i in range(0, len(data), 16):
        row = data[i:i + 16]
        h = " ".join(f"{b:02x}" for b in row[:8]) + "  " + " ".join(f"{b:02x}" for b in row[8:])
        a = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        yield f"{off + i:08x}  {h:<48}  |{a}|\n"


def streams(c: Conn, out, hexdump: bool, events=()) -> None:
    """A connection's streams; before them its life (events: (ts_ns, text)
    of its state, owner, reset, error and destroy records, in order), each
    at its time after the first."""
    pids = ", ".join(map(str, sorted(c.pids)))
    out.write(f"conn {c.conn_id}: {escape(c.family)} {endpoint(c.family, c.saddr, c.sport)} -> "
              f"{endpoint(c.family, c.daddr, c.dport)}, pid {pids} ({escape(c.comm)})"
              f"{', closed' if c.eof else ''}\n")
    for ts, text in events:
        out.write(f"  +{(ts - events[0][0]) / 1e6:.3f} ms  {text}\n")
    for d, s in c.streams.items():
        _stream(out, d, s, c.total(d), *c.ends(d), hexdump)
    for d, s in c.tls.items():             # its TLS plaintext, after the bytes on the wire
        _stream(out, f"tls {d}", s, 0, *c.ends(d), hexdump, what="plaintext bytes")


def _stream(out, label: str, s: Stream, total: int, frm: str, to: str, hexdump: bool,
            what: str = "bytes") -> None:
    end = s.end(total)
    runs = s.runs()
    holes = s.holes(total)
    out.write(f"==> {label} {frm} -> {to}: {end} {what} in {len(s.calls)} call(s), "
              f"{sum(len(b) for _, b in runs)} captured\n")
    at_line_start = True
    for off, item in sorted([(o, b) for o, b in runs] + [(o, h) for o, *h in holes],
                            key=lambda x: x[0]):
        if isinstance(item, bytes):
            if hexdump:
                out.writelines(_hexdump(off, item))
            else:
                t = _text(item)
                out.write(t)
                at_line_start = t.endswith("\n")
        else:
            out.write(("" if at_line_start else "\n") + _hole_text(off, *item, s) + "\n")
            at_line_start = True
    if not at_line_start:
        out.write("\n")


# ---- the command ---------------------------------------------------------

def _args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="nettap read",
        description="Read nettap's JSON-lines capture files (rotated ones included, taken oldest first: "
                    "capture.jsonl.3 ... capture.jsonl.1, capture.jsonl). Without --conn or --pcap: "
                    "list the connections.")
    p.add_argument("files", nargs="*", metavar="FILE")
    p.add_argument("--conn", type=int, action="append", default=[], metavar="ID",
                   help="print this connection's byte streams, each direction in stream order, "
                        "with what was not captured marked (repeatable; with --pcap: only filters)")
    p.add_argument("--hex", action="store_true", help="with --conn: a hex dump instead of text")
    p.add_argument("--dns", action="store_true",
                   help="list the DNS queries (capture.dns) with their answers and latency (with --pid: that "
                        "process's)")
    p.add_argument("--port", type=int, action="append", default=[],
                   help="only connections with this local or remote port")
    p.add_argument("--pid", type=int, action="append", default=[], help="only connections a call of this process moved")
    p.add_argument("--pcap", metavar="OUT",
                   help="write the connections as synthesized TCP segments to the pcap file OUT "
                        "(Wireshark, tshark), at wall-clock times from the capture's clock lines")
    p.add_argument("--nats", metavar="URL", action="append", default=[],
                   help="read the stream nettap ingest wrote instead of files (nats://[user:password@]host:port; "
                        "repeatable: a cluster's nodes)")
    p.add_argument("--stream", default="NETTAP", help="with --nats: the stream (default NETTAP)")
    p.add_argument("--node", action="append", default=[], help="with --nats: only this node's records (repeatable)")
    return p.parse_args(argv)


def main(argv: List[str]) -> int:
    args = _args(argv)
    if bool(args.files) == bool(args.nats):
        print("nettap read: give capture files or --nats URL (one of them)", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except BrokenPipeError:                     # the reader went away (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _from_stream(args: argparse.Namespace) -> list:
    """The stream's records as in-memory files, one per node: [(name, file, size)]."""
    import asyncio
    import io
    import nats
    from exporter.ingest import source

    async def fetch():
        nc = await nats.connect(args.nats, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=5)
        try:
            return await source.fetch(nc, args.stream)
        finally:
            await nc.close()
    by_node = source.lines(asyncio.run(fetch()))
    out = []
    for node, lines in sorted(by_node.items()):
        if args.node and node not in args.node:
            continue
        data = b"".join(lines)
        out.append((f"nats:{args.stream}:{node}", io.BytesIO(data), len(data)))
    return out


def _run(args: argparse.Namespace) -> int:
    files, rc = [], 0
    if args.nats:
        try:
            files = _from_stream(args)
        except Exception as e:                  # the engine's errors: one line, not a traceback
            print(f"nettap read: cannot read stream {escape(args.stream)} from {escape(','.join(args.nats))}: "
                  f"{escape(str(e) or type(e).__name__)}", file=sys.stderr)
            return 1
    for name in ordered(args.files):
        try:
            f = os.fdopen(open_regular(name), "rb")      # a FIFO is refused, never waited on
            files.append((name, f, os.fstat(f.fileno()).st_size))
        except OSError as e:
            print(f"nettap read: cannot read {escape(name)}: {e.strerror}", file=sys.stderr)
            rc = 1
    problems = Problems()
    cap = Capture()
    for rec in records(files, problems):
        cap.add(rec)
    line = problems.line()
    if line:
        print(escape(line), file=sys.stderr)
    conns = select(cap.conns.values(), args.port, args.pid, args.conn)
    out = sys.stdout
    if hasattr(out, "reconfigure"):             # payload and task names are UTF-8, whatever the locale
        out.reconfigure(encoding="utf-8", errors="replace")
    if args.dns:
        dns_listing(cap, args.pid, out)
        return rc
    if not args.conn and not args.pcap:
        listing(cap, conns, out)
        return rc
    if not conns:
        print("nettap read: no connection matches", file=sys.stderr)
        return 1
    keys = {c.key for c in conns}
    ids = {c.conn_id for c in conns}
    full = Capture()
    for rec in records(files, None, lambda r: type(r.get("conn_id")) is int and r["conn_id"] in ids):
        full.add(rec, keep=True)
    conns = [full.conns[k] for k in cap.conns if k in keys and k in full.conns]
    if args.pcap:
        from exporter.commands.pcap import write_pcap
        try:
            n, written, notes = write_pcap(conns, args.pcap, cap.clock_track, full.pods)
        except OSError as e:
            print(f"nettap read: cannot write {escape(args.pcap)}: {e.strerror}", file=sys.stderr)
            return 1
        for note in notes:
            print(f"nettap read: {escape(note)}", file=sys.stderr)
        print(f"nettap read: wrote {n} packets of {written} connection(s) to {args.pcap}",
              file=sys.stderr)
        return rc
    for c in conns:
        streams(c, out, args.hex, sorted(full.events.get(c.conn_id, ())))
    return rc
