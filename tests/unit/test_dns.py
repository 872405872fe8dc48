"""exporter/capture/dns.py: DNS messages of the dns ring decoded (dnspython)
and matched, fed numpy records as the drain gives them."""
import ipaddress

import dns.edns
import dns.message
import dns.rcode
import dns.rrset
import numpy as np
import pytest

from exporter.capture import dns as D
from exporter.capture import records as R
from exporter.kernel import tcp_h

EGRESS, INGRESS = tcp_h.DIR_EGRESS, tcp_h.DIR_INGRESS


def wire_query(name="a.example.", rdtype="A", qid=7):
    q = dns.message.make_query(name, rdtype)
    q.id = qid
    return q


def wire_answer(q, rcode="NOERROR", answers=1):
    r = dns.message.make_response(q)
    r.set_rcode(dns.rcode.from_text(rcode))
    for i in range(answers):
        r.answer.append(dns.rrset.from_text(q.question[0].name, 60, "IN", "A", f"10.0.0.{i + 1}"))
    return r.to_wire()


SERVER = ("10.0.0.53", 53)


def recs(*msgs):
    """dns records: (ts_ns, socket inode, direction, bytes[, size, flags[,
    (the peer's address, its port)]]), the peer SERVER unless given."""
    out = np.zeros(len(msgs), R.DTYPES["dns"])
    for r, m in zip(out, msgs):
        ts, ino, direction, data, *rest = m
        size = rest[0] if rest and rest[0] is not None else len(data)
        r["ts_ns"], r["sock_ino"], r["direction"], r["size"] = ts, ino, direction, size
        r["len"] = min(len(data), tcp_h.DNS_DATA)
        r["flags"] = rest[1] if len(rest) > 1 else 0
        r["data"] = data[:tcp_h.DNS_DATA].ljust(tcp_h.DNS_DATA, b"\0")
        addr, port = rest[2] if len(rest) > 2 else SERVER
        ip = ipaddress.ip_address(addr)
        r["family"] = 2 if ip.version == 4 else 10
        r["daddr"] = ip.packed.ljust(16, b"\0")
        r["dport"] = port
    return out


def test_decode_names_a_query_and_its_answer():
    q = wire_query("www.example.org.", "AAAA", 99)
    assert D.decode(q.to_wire()) == D.Message(99, False, "NOERROR", "www.example.org.", "AAAA", 0)
    assert D.decode(wire_answer(q, answers=2)) == D.Message(99, True, "NOERROR", "www.example.org.", "AAAA", 2)


def test_decode_of_a_cut_message_reads_its_header_and_question():
    """A message longer than a record holds: its question is read, the
    answer count comes from the header."""
    q = wire_query()
    full = wire_answer(q, answers=40)
    assert len(full) > tcp_h.DNS_DATA
    with pytest.raises(ValueError):
        D.decode(full[:tcp_h.DNS_DATA])                   # as a whole message it is cut
    assert D.decode(full[:tcp_h.DNS_DATA], complete=False).answers == 40


@pytest.mark.parametrize("garbage", [b"", b"\x00\x07", b"\x00\x07\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00\xff",
                                     b"\x00\x07\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00", bytes(range(64))])
def test_decode_refuses_what_is_not_a_message(garbage):
    with pytest.raises(ValueError):
        D.decode(garbage)


def test_tracker_matches_answers_to_queries_by_socket_and_id():
    t = D.DnsTracker(clock=lambda: 0)
    a, nx = wire_query(qid=1), wire_query("nx.example.", qid=2)
    t.observe(recs((1_000_000, 5, EGRESS, a.to_wire()), (1_000_000, 5, EGRESS, nx.to_wire()),
                   (1_000_000, 6, EGRESS, wire_query(qid=1).to_wire()),      # same id, another socket
                   (4_000_000, 5, INGRESS, wire_answer(a)),
                   (9_000_000, 5, INGRESS, wire_answer(nx, "NXDOMAIN", 0))))
    c = t.snapshot()
    assert c.queries == {"NOERROR": 1, "NXDOMAIN": 1}
    assert c.latency_buckets[-1] == 2 and c.latency_sum == pytest.approx(0.011)
    assert c.latency_buckets[D.LATENCY_BUCKETS.index(0.005)] == 1       # 3 ms
    assert c.latency_buckets[D.LATENCY_BUCKETS.index(0.01)] == 2        # and 8 ms
    assert (c.malformed, c.unmatched) == (0, 0)
    t.expire(1_000_000 + 5 * 10 ** 9 + 1)                               # socket 6's query: never answered
    assert t.snapshot().queries == {"NOERROR": 1, "NXDOMAIN": 1, "timeout": 1}


def test_tracker_counts_what_matches_nothing_and_what_is_not_dns():
    t = D.DnsTracker(clock=lambda: 0)
    q = wire_query(qid=3)
    t.observe(recs((1, 5, INGRESS, wire_answer(q)),                    # no query seen: unmatched
                   (2, 5, INGRESS, b"\xde\xad"),                       # not DNS
                   (3, 5, EGRESS, q.to_wire(), len(q.to_wire()), 1)))  # unreadable (read_failed)
    c = t.snapshot()
    assert (c.queries, c.malformed, c.unmatched) == ({}, 2, 1)


def test_tracker_bounds_the_queries_awaiting_answers(monkeypatch):
    """Past MAX_PENDING the oldest query is no longer followed: lost, not a
    timeout (its answer may yet come)."""
    monkeypatch.setattr(D, "MAX_PENDING", 3)
    t = D.DnsTracker(clock=lambda: 0)
    t.observe(recs(*[(i, 9, EGRESS, wire_query(qid=i).to_wire()) for i in range(5)]))
    assert t.snapshot().queries == {"lost": 2}


def test_a_query_unanswered_while_the_ring_dropped_records_is_lost_not_a_timeout():
    """The dns ring dropped records after a query was sent: its answer may
    be one of them, so the query counts as lost; a query sent after the
    drops were seen, unanswered, is a timeout."""
    now, drops = [0], [0]
    t = D.DnsTracker(timeout=1.0, clock=lambda: now[0], drops=lambda: drops[0])
    t.observe(recs((10, 5, EGRESS, wire_query(qid=1).to_wire())))
    now[0], drops[0] = 100, 3                      # records dropped after the query: seen at 100
    t.observe(recs((50, 5, EGRESS, wire_query(qid=2).to_wire())))
    now[0] = 200
    t.observe(recs((150, 5, EGRESS, wire_query(qid=3).to_wire())))     # sent after: no drop since
    now[0] = 2 * 10 ** 9
    assert t.snapshot().queries == {"lost": 2, "timeout": 1}


def test_an_answer_counts_only_from_the_server_its_query_went_to():
    """The query's id from another port or address matches nothing
    (unmatched); the server's own answer then counts. The same query sent to
    two servers (musl asks each nameserver from one socket) counts once, at
    the first answer from either."""
    t = D.DnsTracker(clock=lambda: 0)
    q, q2 = wire_query(qid=11), wire_query("b.example.", qid=12)
    t.observe(recs((1, 5, EGRESS, q.to_wire()),
                   (2, 5, INGRESS, wire_answer(q, "NXDOMAIN", 0), None, 0, ("10.0.0.53", 5353)),
                   (3, 5, INGRESS, wire_answer(q, "NXDOMAIN", 0), None, 0, ("10.0.0.54", 53)),
                   (4, 5, INGRESS, wire_answer(q)),
                   (5, 6, EGRESS, q2.to_wire()),
                   (6, 6, EGRESS, q2.to_wire(), None, 0, ("fd00::53", 53)),
                   (7, 6, INGRESS, wire_answer(q2), None, 0, ("fd00::53", 53)),
                   (8, 6, INGRESS, wire_answer(q2))))              # the first server's, too late
    c = t.snapshot()
    assert (c.queries, c.unmatched) == ({"NOERROR": 2}, 3)


def test_an_ipv4_mapped_server_is_its_ipv4_address():
    t = D.DnsTracker(clock=lambda: 0)
    q = wire_query(qid=13)
    t.observe(recs((1, 5, EGRESS, q.to_wire(), None, 0, ("::ffff:10.0.0.53", 53)), (2, 5, INGRESS, wire_answer(q))))
    assert t.snapshot().queries == {"NOERROR": 1}


def with_rcode(q, value):
    r = dns.message.make_response(q)
    r.use_edns(0)
    r.set_rcode(value)
    return r.to_wire()


def test_extended_response_codes_are_bounded_to_the_named_ones_and_other():
    """An answer's extended response code (EDNS: 12 bits) is counted by its
    name when it has one, else as other: 4,096 values make 21 series."""
    assert D.decode(with_rcode(wire_query(), 16)).rcode == "BADVERS"
    assert D.decode(with_rcode(wire_query(), 23)).rcode == "BADCOOKIE"
    assert D.decode(with_rcode(wire_query(), 4095)).rcode == "other"
    assert D.decode(with_rcode(wire_query(), 12)).rcode == "other"
    t = D.DnsTracker(clock=lambda: 0)
    batch = []
    for code in range(4096):
        q = wire_query(qid=code)
        batch += [(1, 5, EGRESS, q.to_wire()), (2, 5, INGRESS, with_rcode(q, code))]
    t.observe(recs(*batch))
    queries = t.snapshot().queries
    assert set(queries) == set(D.RCODES) | {"other"}, sorted(queries)
    assert sum(queries.values()) == 4096 and queries["other"] == 4096 - len(D.RCODES)


def test_a_late_answer_counts_once_as_a_timeout():
    t = D.DnsTracker(timeout=1.0, clock=lambda: 0)
    q = wire_query(qid=4)
    t.observe(recs((0, 5, EGRESS, q.to_wire())))
    t.expire(2 * 10 ** 9)
    t.observe(recs((2 * 10 ** 9, 5, INGRESS, wire_answer(q))))
    c = t.snapshot()
    assert (c.queries, c.unmatched, c.latency_buckets[-1]) == ({"timeout": 1}, 1, 0)


def framed(*msgs):
    return b"".join(len(m).to_bytes(2, "big") + m for m in msgs)


@pytest.mark.parametrize("cuts", [(), (1,), (2,), (1, 2, 3), (5, 20)])
def test_stream_cuts_a_tcp_connection_into_its_messages(cuts):
    """Two messages, however the calls split their bytes (the length alone,
    one byte at a time, two messages in one call)."""
    a, b = wire_query(qid=1).to_wire(), wire_answer(wire_query(qid=2))
    stream, data, out, at = D.Stream(), framed(a, b), [], 0
    for end in [*cuts, len(framed(a, b))]:
        out += stream.feed(data[at:end], end - at)
        at = end
    assert out == [(a, True), (b, True)] and not stream.broken


def test_stream_gives_a_message_cut_short_and_keeps_its_framing():
    """A call's bytes past what a record holds are counted, not recorded:
    that message is given incomplete, the next one whole."""
    big = wire_answer(wire_query(qid=1), answers=60)
    small = wire_query(qid=2).to_wire()
    data = framed(big, small)
    stream = D.Stream()
    out = stream.feed(data[:tcp_h.DNS_DATA], len(big) + 2)           # one call: the length and the big answer
    out += stream.feed(data[len(big) + 2:], len(small) + 2)
    assert [c for _, c in out] == [False, True] and out[1][0] == small
    assert D.decode(out[0][0], complete=False).answers == 60


def test_stream_whose_length_was_not_recorded_is_broken():
    stream = D.Stream()
    assert stream.feed(b"", 600) == [] and stream.broken       # read failed: no byte recorded
    assert stream.feed(framed(wire_query().to_wire()), 40) == []


def test_tracker_follows_tcp_connections():
    t = D.DnsTracker(clock=lambda: 0)
    q = wire_query(qid=5)
    recs_ = recs((1_000_000, 7, EGRESS, framed(q.to_wire())),
                 (2_000_000, 7, INGRESS, framed(wire_answer(q, "REFUSED", 0))[:2]),      # the length read alone
                 (3_000_000, 7, INGRESS, framed(wire_answer(q, "REFUSED", 0))[2:]))
    recs_["transport"] = tcp_h.TRANSPORT_TCP
    t.observe(recs_)
    c = t.snapshot()
    assert (c.queries, c.latency_sum) == ({"REFUSED": 1}, pytest.approx(0.002))


def test_stream_keeps_at_most_max_kept_bytes_of_a_message(monkeypatch):
    """A long message recorded whole is kept only to MAX_KEPT bytes: given
    as cut short, its header and question still read."""
    monkeypatch.setattr(D, "MAX_KEPT", 64)
    big = wire_answer(wire_query(qid=9), answers=30)
    stream = D.Stream()
    out = []
    for at in range(0, len(framed(big)), 500):
        piece = framed(big)[at:at + 500]
        out += stream.feed(piece, len(piece))
    assert [(len(m), c) for m, c in out] == [(64, False)]
    assert D.decode(out[0][0], complete=False).answers == 30


def _corpus():
    """Messages of every shape decode meets, and broken ones."""
    import random
    rnd = random.Random(45)
    out = []
    for name, rdtype in [("a.example.", "A"), ("www.Example-1.org.", "AAAA"), ("_srv._tcp.example.", "SRV"),
                         ("sp ace.example.", "A"), (".", "NS"), ("x" * 63 + ".example.", "TXT")]:
        for edns in (False, True):
            q = dns.message.make_query(name, rdtype, use_edns=0 if edns else None,
                                       options=[dns.edns.GenericOption(65001, b"xy")] if edns else None)
            out.append(q.to_wire())
            r = dns.message.make_response(q)
            if rdtype in ("A", "AAAA"):
                r.answer.append(dns.rrset.from_text(name, 60, "IN", rdtype, "10.0.0.1" if rdtype == "A" else "fd00::1"))
                r.answer.append(dns.rrset.from_text(name, 60, "IN", "CNAME", "b.example."))
            out.append(r.to_wire())
            for code in (3, 16, 4095):
                r.set_rcode(code)
                out.append(r.to_wire())
    a = wire_answer(wire_query(qid=3), answers=3)
    out += [a + b"\0", a[:12] + b"\x03abc\x00\x00\x01\x00\x01", bytes(a[:2]) + b"\x81\x80" + bytes(a[4:])]
    opt = b"\x00\x00\x29\x10\x00\x00\x00\x00\x00\x00\x00"                  # an OPT record, no options
    q = wire_query(qid=4).to_wire()
    out += [q[:11] + b"\x02" + q[12:] + opt + opt,                          # two OPTs
            q[:7] + b"\x01" + q[8:11] + b"\x00" + q[12:] + opt,             # an OPT in the answers
            q[:11] + b"\x01" + q[12:] + opt[:-2] + b"\x00\x03\x00\x01\x00"]  # an option cut short
    for m in list(out):
        out += [m[:n] for n in range(12, len(m), 3)]
        for _ in range(5):
            b = bytearray(m)
            b[rnd.randrange(12, len(b))] = rnd.randrange(256)
            out.append(bytes(b))
    return out


def test_the_fast_decoder_agrees_with_dnspython_or_leaves_it_the_message():
    """decode's own parser (the common messages, without dnspython) gives
    exactly dnspython's answer, or none (dnspython decides), for every
    message of the corpus, whole or cut short."""
    fast = 0
    for m in _corpus():
        for complete in (True, False):
            got = D._fast(m, complete)
            try:
                want = D._parsed(m, complete)
            except ValueError:
                want = None
            assert got is None or got == want, (m, complete, got, want)
            fast += got is not None
    assert fast > 200


def test_the_fast_decoders_type_names_are_dnspythons():
    import dns.rdatatype
    assert all(dns.rdatatype.to_text(t) == name for t, name in D._TYPES.items())
