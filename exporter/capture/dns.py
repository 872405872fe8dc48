"""The dns ring's messages decoded and matched: what captured workloads asked
their resolvers, what they were told, and how long it took.

The kernel publishes each DNS message a captured workload sends to UDP port
53, or receives on a socket it sent one from, and each call's bytes on its TCP
connections to port 53 (bpf/dns.bpf.c), with at most NETTAP_DNS_DATA of their
bytes; :class:`Stream` cuts a TCP connection's bytes into its messages.
:class:`DnsTracker` decodes them with dnspython (imported at the first
message: a node that captures no DNS never pays for it) and pairs a query
with its answer by the socket (its inode), the message id and the server (an
answer counts only from an address and port the query went to). A query
unanswered after :data:`TIMEOUT_S` counts as a timeout, unless the dns ring
dropped records while it waited: its answer may be one of them, and it counts
as ``lost`` (so does a query the tracker stopped following, past
:data:`MAX_PENDING`). An answer that matches no query (its query sent before
nettap looked, or after the timeout), and a message that does not parse, are
counted apart. The response code is one of :data:`RCODES`, else ``other``: an
extended code (EDNS) has 4,096 values, a label must not.

Thread-safety: :meth:`DnsTracker.observe` runs in the drain thread,
:meth:`DnsTracker.snapshot` in a scrape's; one lock guards the counts.
"""
from __future__ import annotations

import collections
import struct
import threading
import time
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from exporter.kernel import tcp_h

# glibc's default (resolv.conf `options timeout:5`): a stub resolver asks again
# or gives up after this long, so an answer later than it answers nothing.
TIMEOUT_S = 5.0
# Queries awaiting an answer, at most (the oldest is no longer followed: lost).
MAX_PENDING = 4096
# The response codes counted by name (RFC 1035, 2136, 6891, 8945, 7873,
# 8490: IANA's "DNS RCODEs"); any other counts as "other".
RCODES = ("NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "YXDOMAIN", "YXRRSET", "NXRRSET",
          "NOTAUTH", "NOTZONE", "DSOTYPENI", "BADVERS", "BADKEY", "BADTIME", "BADMODE", "BADNAME", "BADALG",
          "BADTRUNC", "BADCOOKIE")
# What a query counts as when no answer does: none came within the timeout,
# or the ring dropped records meanwhile (the answer may be one) or the
# tracker stopped following it.
TIMEOUT, LOST, OTHER = "timeout", "lost", "other"
# TCP connections to port 53 followed at once (the least recent is forgotten),
# and the bytes of a message kept of each (a longer one is read as cut short):
# 1,024 x 4 KiB at most, where a message may be 64 KiB.
MAX_STREAMS = 1024
MAX_KEPT = 4096
# Seconds: a node-local cache answers in well under a millisecond, a
# resolver across a region in tens of milliseconds; 5 is the timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_HEADER = struct.Struct("!6H")      # id, flags, qdcount, ancount, nscount, arcount (RFC 1035 4.1.1)
_QR = 0x8000
_NAMED = frozenset(RCODES)
_RCODE_NAMES = dict(zip((*range(12), *range(16, 24)), RCODES))
_READ_FAILED = next(bit for bit, name in tcp_h.NAMES["CHUNK_F"].items() if name == "read_failed")


class Message(NamedTuple):
    id: int
    response: bool
    rcode: str          # a name of RCODES (NOERROR, NXDOMAIN, SERVFAIL, ...), else "other"
    name: str           # the question's name, absolute (a trailing dot)
    qtype: str          # the question's type: A, AAAA, SRV, ...
    answers: int        # records in the answer section


def decode(data: bytes, complete: bool = True) -> Message:
    """One message's header and question. complete: data is the whole
    message (else its first bytes only: the answers are not parsed). Raises
    ValueError for what is not a DNS message with one question."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{len(data)} bytes: shorter than a DNS header")
    return _fast(data, complete) or _parsed(data, complete)


def _parsed(data: bytes, complete: bool) -> Message:
    """decode by dnspython: every message, whatever it holds."""
    import dns.exception
    import dns.message
    import dns.rcode
    import dns.rdatatype
    _id, flags, qdcount, ancount, _ns, _ar = _HEADER.unpack_from(data)
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    try:
        m = dns.message.from_wire(data, question_only=not complete, ignore_trailing=not complete)
    except (dns.exception.DNSException, ValueError, IndexError, struct.error) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    q = m.question[0]
    rcode = dns.rcode.to_text(m.rcode())
    return Message(m.id, bool(flags & _QR), rcode if rcode in _NAMED else OTHER, q.name.to_text(),
                   dns.rdatatype.to_text(q.rdtype), ancount)


# What _fast reads itself: a question name of plain labels (dnspython's text
# of them is their bytes), and records of these types in class IN, each
# owned by the question's name (a pointer to it); OPT once, in the
# additional section, owned by the root. Anything else goes to dnspython.
_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_RR = struct.Struct("!HHIH")            # type, class, ttl, rdlength (RFC 1035 4.1.3)
_A, _AAAA, _OPT = 1, 28, 41
_RDLENGTH = {_A: 4, _AAAA: 16}
# The question types stub resolvers ask, named without importing dnspython
# (its import takes ~0.1 s of the drain thread, at the first message);
# another type's name is dnspython's.
_TYPES: Dict[int, str] = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA",
                          33: "SRV", 35: "NAPTR", 43: "DS", 48: "DNSKEY", 64: "SVCB", 65: "HTTPS", 255: "ANY",
                          257: "CAA"}


def _fast(data: bytes, complete: bool) -> Optional[Message]:
    """decode without dnspython, for the common messages (a 30th of its
    time); None for any other, which dnspython then decodes or refuses."""
    qid, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(data)
    if qdcount != 1:
        return None
    pos, labels, end = 12, [], len(data)
    while pos < end and data[pos]:
        n = data[pos]
        label = data[pos + 1:pos + 1 + n]
        if n > 63 or len(label) != n or not _PLAIN.issuperset(label):
            return None
        labels.append(label.decode())
        pos += 1 + n
    if pos + 5 > end or pos > 12 + 254:
        return None
    qtype = int.from_bytes(data[pos + 1:pos + 3], "big")
    pos += 5
    rcode = flags & 0xF
    if complete:
        opt = False
        for i in range(ancount + nscount + arcount):
            additional = i >= ancount + nscount
            if data[pos:pos + 2] == b"\xc0\x0c" and labels:
                pos += 2
                root = False
            elif data[pos:pos + 1] == b"\x00":
                pos += 1
                root = True
            else:
                return None
            if pos + _RR.size > end:
                return None
            rtype, rclass, ttl, rdlength = _RR.unpack_from(data, pos)
            pos += _RR.size + rdlength
            if pos > end:
                return None
            if rtype == _OPT:
                if opt or not additional or not root or not _options_ok(data, pos - rdlength, pos):
                    return None
                opt, rcode = True, rcode | (ttl >> 24) << 4
            elif root or rclass != 1 or _RDLENGTH.get(rtype) != rdlength:
                return None
        if pos != end:
            return None
    name = ".".join(labels) + "." if labels else "."
    text = _TYPES.get(qtype)
    if text is None:
        import dns.rdatatype
        text = _TYPES[qtype] = dns.rdatatype.to_text(qtype)
    return Message(qid, bool(flags & _QR), _RCODE_NAMES.get(rcode, OTHER), name, text, ancount)


def _options_ok(data: bytes, pos: int, end: int) -> bool:
    """An OPT record's options (code, length, data) fill its data exactly."""
    while pos < end:
        if pos + 4 > end:
            return False
        pos += 4 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return pos == end


class Stream:
    """One direction of a TCP connection to port 53 (RFC 1035 4.2.2: each
    message after its length, 2 bytes), fed the pieces the kernel recorded:
    each call's first bytes (data) and how many it moved (size). A message
    whose bytes were not all recorded is given with complete False (its
    header and question are read); a length that was not recorded loses the
    framing, and the rest of the stream is ignored (broken)."""

    def __init__(self) -> None:
        self.head = b""           # the length's bytes seen so far
        self.want = -1            # the current message's length, -1 while reading it
        self.got = 0              # its bytes passed, recorded or not
        self.buf = bytearray()    # its recorded bytes, up to the first one missing
        self.cut = False          # a byte of it was not recorded
        self.broken = self.counted = False

    def feed(self, data: bytes, size: int):
        """The messages this piece completes: [(bytes, complete)]."""
        out, pos = [], 0
        while pos < size and not self.broken:
            if self.want < 0:
                take = min(2 - len(self.head), size - pos)
                if pos + take > len(data):
                    self.broken = True
                    break
                self.head += data[pos:pos + take]
                pos += take
                if len(self.head) == 2:
                    self.want, self.head = int.from_bytes(self.head, "big"), b""
                continue
            take = min(self.want - self.got, size - pos)
            seen = max(0, min(len(data), pos + take) - pos)
            if not self.cut:
                keep = min(seen, MAX_KEPT - len(self.buf))     # the header and question are first
                self.buf += data[pos:pos + keep]
                self.cut = keep < take
            self.got += take
            pos += take
            if self.got == self.want:
                out.append((bytes(self.buf), not self.cut))
                self.want, self.got, self.buf, self.cut = -1, 0, bytearray(), False
        return out


class Counts(NamedTuple):
    """What snapshot() returns: every count since start."""
    queries: Dict[str, int]                  # rcode (or "timeout", "lost") -> queries
    latency_buckets: Tuple[int, ...]         # cumulative, one per LATENCY_BUCKETS and +Inf
    latency_sum: float
    malformed: int
    unmatched: int


def servers(recs) -> list:
    """Each record's peer as (address's low 8 bytes, high 8, port), an
    IPv4-mapped IPv6 address as its IPv4 one (as bpf/dns.bpf.c compares
    them): a dual-stack socket may name its server either way."""
    import numpy as np          # here: importing numpy starts threads, before the daemon drops privileges
    words = np.ascontiguousarray(recs["daddr"]).view("<u8").reshape(-1, 2).tolist()
    out = []
    for (lo, hi), port in zip(words, recs["dport"].tolist()):
        if lo == 0 and hi & 0xFFFFFFFF == 0xFFFF0000:
            lo, hi = hi >> 32, 0
        out.append((lo, hi, port))
    return out


class DnsTracker:
    """Counts of the captured DNS, fed a batch of dns records at a time."""

    def __init__(self, timeout: float = TIMEOUT_S, clock: Callable[[], int] = time.monotonic_ns,
                 drops: Optional[Callable[[], int]] = None):
        """clock: the records' clock (CLOCK_MONOTONIC, bpf_ktime_get_ns);
        drops: the dns ring's records dropped in the kernel so far."""
        self.timeout_ns = int(timeout * 1e9)
        self.clock = clock
        self.drops = drops
        self._lock = threading.Lock()
        self._queries: Dict[str, int] = collections.Counter()
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum = 0.0
        self._malformed = self._unmatched = 0
        # (socket inode, id) -> (the query's ts_ns, the servers it went to), oldest first
        self._pending: "collections.OrderedDict[Tuple[int, int], Tuple[int, set]]" = collections.OrderedDict()
        # (socket inode, sent) -> a TCP connection's bytes in that direction, the most recent last
        self._streams: "collections.OrderedDict[Tuple[int, bool], Stream]" = collections.OrderedDict()
        # The ring's drops when last read, and the clock then if they had
        # grown since the read before: a query sent before that instant may
        # have lost its answer (a drop after it is seen at the next read).
        self._drops_seen, self._drop_ns = 0, -1

    def observe(self, recs) -> None:
        """A batch of dns records (a numpy array of the dns kind), in ring order."""
        cols = zip(recs["ts_ns"].tolist(), recs["sock_ino"].tolist(), recs["direction"].tolist(),
                   recs["len"].tolist(), recs["size"].tolist(), recs["flags"].tolist(),
                   recs["transport"].tolist(), recs["data"], servers(recs))
        for ts_ns, ino, direction, n, size, flags, transport, data, server in cols:
            egress, failed = direction == tcp_h.DIR_EGRESS, bool(flags & _READ_FAILED)
            if transport != tcp_h.TRANSPORT_TCP:
                self._one(ts_ns, ino, server, egress, bytes(data)[:n], n >= size, failed)
                continue
            stream = self._streams.pop((ino, egress), None) or Stream()
            self._streams[(ino, egress)] = stream                    # the most recent last
            if len(self._streams) > MAX_STREAMS:
                self._streams.popitem(last=False)
            for msg, complete in stream.feed(b"" if failed else bytes(data)[:n], size):
                self._one(ts_ns, ino, server, egress, msg, complete, False)
            if stream.broken and not stream.counted:
                stream.counted = True
                with self._lock:
                    self._malformed += 1
        self.expire()

    def _one(self, ts_ns: int, ino: int, server: tuple, egress: bool, data: bytes, complete: bool,
             read_failed: bool) -> None:
        try:
            if read_failed:
                raise ValueError("unreadable")
            m = decode(data, complete)
        except ValueError:
            with self._lock:
                self._malformed += 1
            return
        key = (ino, m.id)
        with self._lock:
            if not m.response:
                if egress:                              # a query sent: await its answer
                    # the same id again on the socket: a retry, or the same
                    # query to another server (musl asks every nameserver)
                    _sent, to = self._pending.pop(key, (0, set()))
                    to.add(server)
                    self._pending[key] = (ts_ns, to)
                    if len(self._pending) > MAX_PENDING:
                        self._pending.popitem(last=False)
                        self._queries[LOST] += 1
                return
            sent, to = self._pending.get(key, (None, ())) if not egress else (None, ())
            if server not in to:                        # no such query, or not to this server
                self._unmatched += 1
                return
            del self._pending[key]
            self._queries[m.rcode] += 1
            seconds = max(ts_ns - sent, 0) / 1e9
            self._sum += seconds
            for i, le in enumerate(LATENCY_BUCKETS):
                if seconds <= le:
                    self._buckets[i] += 1
            self._buckets[-1] += 1

    def expire(self, now_ns: Optional[int] = None) -> None:
        """Count the queries unanswered for longer than the timeout: a
        timeout, or lost when the ring dropped records since it was sent."""
        try:
            drops = self.drops() if self.drops else 0
        except OSError:                         # the maps are gone (closing): as last read
            drops = self._drops_seen
        seen = self.clock()                     # after the read: a drop it shows happened before
        limit = (seen if now_ns is None else now_ns) - self.timeout_ns
        with self._lock:
            if drops != self._drops_seen:
                self._drops_seen, self._drop_ns = drops, seen
            while self._pending:
                key, (sent, _to) = next(iter(self._pending.items()))
                if sent > limit:
                    break
                del self._pending[key]
                self._queries[LOST if sent < self._drop_ns else TIMEOUT] += 1

    def snapshot(self) -> Counts:
        self.expire()
        with self._lock:
            return Counts(dict(self._queries), tuple(self._buckets), self._sum, self._malformed, self._unmatched)
