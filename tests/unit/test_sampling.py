"""capture.sample_connections' hash (exporter/capture/sampling.py, the same
function as bpf/filter.bpf.h's sample_keep): both ends of a connection
decide alike, an IPv4-mapped address as its IPv4 address, and the kept
share is 1 in N over the ports a client is given."""
import pytest

from exporter import config as C
from exporter.capture import sampling


def test_both_ends_decide_alike():
    for sport in range(1000, 1200):
        assert sampling.tuple_hash("10.0.0.1", sport, "10.0.0.2", 443) == \
            sampling.tuple_hash("10.0.0.2", 443, "10.0.0.1", sport)
        assert sampling.tuple_hash("2001:db8::1", sport, "2001:db8::2", 443) == \
            sampling.tuple_hash("2001:db8::2", 443, "2001:db8::1", sport)


def test_a_mapped_address_is_its_ipv4_address():
    assert sampling.tuple_hash("::ffff:10.0.0.1", 5, "::ffff:10.0.0.2", 80) == \
        sampling.tuple_hash("10.0.0.1", 5, "10.0.0.2", 80)
    assert sampling.addr_word("127.0.0.1") == 0x0100007F            # the bytes as a little-endian load


@pytest.mark.parametrize("n,kept", [(2, 14116), (4, 7058), (10, 2822), (100, 282)])
def test_one_in_n_of_a_clients_ports(n, kept):
    """Every local port Linux gives a connect by default (32768-60999) to one
    server: the kept share is 1/N to within 0.12 %."""
    ports = range(32768, 61000)
    assert sum(sampling.keep(n, "127.0.0.1", p, "127.0.0.1", 8080) for p in ports) == kept


def test_threshold_and_the_config():
    assert sampling.threshold(1) == 0 and sampling.threshold(4) == 1 << 30
    assert all(sampling.keep(1, "10.0.0.1", p, "10.0.0.2", 80) for p in range(100))
    with pytest.raises(ValueError):
        sampling.threshold(0)
    assert C.parse({}).sample == 1
    assert C.parse({"capture": {"sample_connections": 10}}).sample == 10
    for bad in (0, -1, "ten", 1 << 25, True):
        with pytest.raises(C.ConfigError, match="capture.sample_connections"):
            C.parse({"capture": {"sample_connections": bad}})
