"""Captured connections as a pcap file: synthesized IPv4/IPv6 TCP segments
(handshake, data at the sequence numbers of the stream offsets, ACKs, FINs)
that Wireshark and tshark dissect and follow, at the wall-clock times of the
capture's clock track. The segments and the file are made by dpkt (see
pyproject.toml for why dpkt)."""
from __future__ import annotations

import heapq
import os
import socket
from bisect import bisect_right
from decimal import Decimal
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import dpkt

from exporter.util import outpath
from exporter.commands.streams import DIRECTIONS, Conn, Stream

# The socket state before TCP_CLOSE says which side sent the first FIN.
_ACTIVE_CLOSE = {"FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT", "CLOSING"}
LINKTYPE_RAW = 101      # pcap-linktype(7): raw IPv4 or IPv6, no link header (dpkt's DLT_RAW is not it)
MAX_SEGMENT = 65_000    # TCP payload per segment: below IPv4's 65,535-byte datagram


def _segments(s: Stream) -> List[Tuple[int, int, bytes, Optional[int]]]:
    """(ts_ns, offset, bytes, call_offset if last of its call else None),
    a segment per call's contiguous bytes."""
    out = []
    pieces = sorted(s.pieces, key=lambda p: p[0])
    pos = 0
    for i, (off, data, co, ts) in enumerate(pieces):
        if off + len(data) <= pos:
            continue
        if off < pos:
            data, off = data[pos - off:], pos
        nxt = pieces[i + 1] if i + 1 < len(pieces) else None
        if out and out[-1][1] + len(out[-1][2]) == off and out[-1][4] == co and len(out[-1][2]) < MAX_SEGMENT:
            out[-1][2] += data
        else:
            out.append([ts, off, bytearray(data), False, co])
        pos = off + len(data)
        if nxt is None or nxt[2] != co:
            out[-1][3] = True
    segs = []
    for ts, off, data, last, co in out:
        for j in range(0, len(data), MAX_SEGMENT):
            part = bytes(data[j:j + MAX_SEGMENT])
            segs.append((ts, off + j, part, co if last and j + MAX_SEGMENT >= len(data) else None))
    return segs


def packets(c: Conn) -> Iterator[Tuple[int, bytes]]:
    """(ts_ns, IP packet) of one connection: a handshake, its data in
    segments whose sequence number is the stream offset + 1 (initial
    sequence numbers 0), each call acknowledged by the peer, and FINs
    when it closed. nettap does not record who connected: the side with
    the higher port (the ephemeral one) sends the SYN. A connection with
    TLS plaintext has it as its data, in place of the bytes on the wire
    (what Wireshark would show with the session's keys)."""
    streams = c.tls or c.streams

    def total(d: str) -> int:                   # the eof's totals count the bytes on the wire
        return 0 if c.tls else c.total(d)

    v6 = c.family == "ipv6"
    af = socket.AF_INET6 if v6 else socket.AF_INET
    addr = {"egress": (socket.inet_pton(af, c.saddr), c.sport, socket.inet_pton(af, c.daddr), c.dport)}
    a = addr["egress"]
    addr["ingress"] = (a[2], a[3], a[0], a[1])
    peer = {"egress": "ingress", "ingress": "egress"}
    sent = {"egress": 0, "ingress": 0}         # bytes each side has sent so far, captured or not
    F = dpkt.tcp

    def pkt(d: str, flags: int, data: bytes = b"", seq: Optional[int] = None) -> bytes:
        src, sport, dst, dport = addr[d]
        seq = (1 + (sent[d] if seq is None else seq)) & 0xFFFFFFFF
        ack = (1 + sent[peer[d]]) & 0xFFFFFFFF if flags & F.TH_ACK else 0
        tcp = F.TCP(sport=sport, dport=dport, seq=seq, ack=ack, flags=flags, win=65535, data=data)
        if v6:
            return bytes(dpkt.ip6.IP6(src=src, dst=dst, nxt=6, hlim=64, plen=len(tcp), data=tcp))
        return bytes(dpkt.ip.IP(src=src, dst=dst, p=6, ttl=64, len=20 + len(tcp), data=tcp))

    client = "egress" if c.sport >= c.dport else "ingress"      # egress = the local side sends
    segs = list(heapq.merge(*[[(ts, i, d, off, data, co) for ts, off, data, co in _segments(streams[d])]
                              for i, d in enumerate(DIRECTIONS)]))
    t = min([s[0] for s in segs] + ([c.eof["start_ns"]] if c.eof else []) + [c.first_ts]) - 3000
    t = max(t, 0)
    yield t, pkt(client, F.TH_SYN, seq=-1)                      # seq -1 + 1: the ISN, 0
    yield t + 1000, pkt(peer[client], F.TH_SYN | F.TH_ACK, seq=-1)
    yield t + 2000, pkt(client, F.TH_ACK)
    t += 2000
    for ts, _, d, off, data, co in segs:
        t = max(t, ts)                          # never back in time within a connection
        yield t, pkt(d, F.TH_ACK | (F.TH_PUSH if co is not None else 0), data, seq=off)
        sent[d] = max(sent[d], off + len(data))
        if co is not None:                      # the whole call was sent, captured or not
            sent[d] = max(sent[d], co + streams[d].calls[co][0])
            yield t, pkt(peer[d], F.TH_ACK)
    if c.eof:
        for d in DIRECTIONS:
            sent[d] = max(sent[d], streams[d].end(total(d)))
        t = max(t, c.eof["ts_ns"])
        first = "egress" if c.eof["oldstate"] in _ACTIVE_CLOSE else "ingress"
        yield t, pkt(first, F.TH_FIN | F.TH_ACK)
        sent[first] += 1
        yield t, pkt(peer[first], F.TH_FIN | F.TH_ACK)
        sent[peer[first]] += 1
        yield t, pkt(first, F.TH_ACK)


NO_CLOCK = ("no clock line in the input (files of a nettap before the clock track): packet times are "
            "CLOCK_MONOTONIC, since boot (Wireshark shows 1970)")


def wall_clock(track: Sequence[Tuple[int, int]]) -> Optional[Callable[[int], int]]:
    """ts_ns (CLOCK_MONOTONIC) -> CLOCK_REALTIME ns, by the clock track's
    lines (ts_ns, real_ns: the two clocks read together, about once a
    second, exporter/capture/pipeline.py): the offset of the last line at or
    before ts_ns, or of the first line for a time before them all. None
    without a line."""
    if not track:
        return None
    track = sorted(track)
    at = [t for t, _ in track]
    offsets = [real - t for t, real in track]
    return lambda ts: ts + offsets[max(0, bisect_right(at, ts) - 1)]


def write_pcap(conns: List[Conn], path: str, track: Sequence[Tuple[int, int]] = (),
               pods: Optional[dict] = None) -> Tuple[int, int, List[str]]:
    """Write the connections' packets, merged in time order, to path, at
    wall-clock times by track (the clock lines' (ts_ns, real_ns); without
    one, at CLOCK_MONOTONIC, and a note says so). Returns (packets written,
    connections written, notes: those left out, those whose payload is TLS
    plaintext). A file with TLS plaintext, or with connections of a pod
    (pods: Conn.key -> its pod and container, from the owner lines), is
    pcapng, so that a comment can say which packets were decrypted, and a
    connection's first packet whose it is."""
    pods = pods or {}
    notes, chosen, seen = [], [], {}
    wall = wall_clock(track)
    if wall is None:
        notes.append(NO_CLOCK)
    for c in conns:
        try:
            af = socket.AF_INET6 if c.family == "ipv6" else socket.AF_INET
            socket.inet_pton(af, c.saddr), socket.inet_pton(af, c.daddr)
        except OSError:
            notes.append(f"conn {c.conn_id}: family {c.family} addresses {c.saddr}, {c.daddr} are not IP: left out")
            continue
        mirror = seen.get((c.family, c.daddr, c.dport, c.saddr, c.sport))
        if mirror is not None:                  # both ends captured (loopback): one TCP connection
            notes.append(f"conn {c.conn_id} is the other end of conn {mirror.conn_id} (the same TCP "
                         f"connection): left out of the pcap")
            continue
        seen[(c.family, c.saddr, c.sport, c.daddr, c.dport)] = c
        chosen.append(c)
        if c.tls:
            notes.append(f"conn {c.conn_id}: its TLS plaintext (decrypted: read by nettap from the process's "
                         f"libssl calls) is its payload, in place of the encrypted bytes on the wire")
    n = 0
    merged = heapq.merge(*[_commented(c, pods.get(c.key, "")) for c in chosen], key=lambda x: x[0])
    if wall is not None:
        merged = _in_wall_time(merged, wall)
    with os.fdopen(outpath.create_for_writing(path), "wb") as f:
        if not any(c.tls or c.key in pods for c in chosen):
            w = dpkt.pcap.Writer(f, snaplen=262144, linktype=LINKTYPE_RAW, nano=True)
            late = 0
            for ts, _, p in merged:
                if ts > _PCAP_MAX_NS:               # a file's ts_ns past 2^32 s: not nettap's clock
                    ts, late = _PCAP_MAX_NS, late + 1
                # exact: a float's rounding could make the nanoseconds 10^9
                w.writepkt_time(p, Decimal(ts) / 1_000_000_000)
                n += 1
            if late:
                notes.append(f"{late} packet(s) timed past what a pcap holds (2^32 s): written at its last "
                             "second")
        else:
            n = _write_pcapng(f, merged, any(c.tls for c in chosen))
    return n, len(chosen), notes


def _in_wall_time(merged, wall: Callable[[int], int]):
    """The packets at wall-clock times, never going back: a step of the wall
    clock between two clock lines (NTP setting it) must not reorder them."""
    last = 0
    for ts, note, p in merged:
        last = min(max(last, wall(ts)), _U64)       # (a file's ts_ns near 2^64 is not nettap's clock)
        yield last, note, p


_PCAP_MAX_NS = (1 << 32) * 1_000_000_000 - 1     # a pcap record's time: u32 seconds, u32 nanoseconds
_U64 = (1 << 64) - 1                              # a pcapng record's: u64 nanoseconds
_DECRYPTED = "TLS plaintext decrypted by nettap: read from the process's libssl calls, not from the wire"


def _commented(c: Conn, pod: str):
    """(ts_ns, the packet's comment, packet) of a connection's packets: its
    first one says its pod, each of a TLS connection's that it is decrypted."""
    for i, (ts, p) in enumerate(packets(c)):
        notes = ([f"nettap conn {c.conn_id}: {pod}"] if pod and not i else []) + ([_DECRYPTED] if c.tls else [])
        yield ts, "; ".join(notes), p


def _write_pcapng(f, merged, tls: bool) -> int:
    """pcapng, for a file with TLS plaintext or pods in it: a comment on the
    file and on each of the TLS connections' packets says the payload was
    decrypted, and on each pod's connection's first packet whose it is
    (classic pcap has no comments). Nanosecond timestamps, as the pcap."""
    P = dpkt.pcapng

    def opts(*pairs):
        return [P.PcapngOptionLE(code=c, data=d) for c, d in pairs] + [P.PcapngOptionLE(code=P.PCAPNG_OPT_ENDOFOPT)]

    about = _DECRYPTED + " (some connections)" if tls else "the pods' connections named in their first packets"
    shb = P.SectionHeaderBlockLE(opts=opts((P.PCAPNG_OPT_COMMENT, about.encode()),
                                           (P.PCAPNG_OPT_SHB_USERAPPL, b"nettap read")))
    idb = P.InterfaceDescriptionBlockLE(snaplen=262144, linktype=LINKTYPE_RAW,
                                        opts=opts((P.PCAPNG_OPT_IF_TSRESOL, b"\x09")))
    w = P.Writer(f, shb=shb, idb=idb)
    n = 0
    for ts, note, p in merged:
        epb = P.EnhancedPacketBlockLE(ts_high=ts >> 32, ts_low=ts & 0xFFFFFFFF, caplen=len(p), pkt_len=len(p),
                                      pkt_data=p, opts=opts((P.PCAPNG_OPT_COMMENT, note.encode())) if note else [])
        w.writepkt(epb)
        n += 1
    return n
