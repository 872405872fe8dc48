"""capture.sample_connections: which connections the kernel keeps, 1 in N.

The kernel decides (bpf/filter.bpf.h: sample_keep) by a hash of the
connection's two ends, each (address, port), taken in order so that the
client's socket and the server's decide alike, on one host or on two: nettaps
with the same N capture the same connections at both ends (a NAT between
them rewrites an end, and so the decision). No seed, for that reason. This
is the same function, for tests and for anyone predicting what a node
captured: threshold() is what user space writes into capture_config, keep()
what the kernel computes.
"""
MASK64 = (1 << 64) - 1
_K1, _K2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def threshold(n: int) -> int:
    """capture_config.sample_threshold for 1 in n: kept when the hash is below
    it (0: sampling off, every connection kept)."""
    if n < 1:
        raise ValueError(f"sample_connections: 1 in {n}")
    return 0 if n == 1 else (1 << 32) // n


def addr_word(addr: str) -> int:
    """An address as the kernel folds it: IPv4's 4 bytes as the CPU loads them
    (little-endian here); an IPv6 address the XOR of its four words, an
    IPv4-mapped one (::ffff:a.b.c.d) its IPv4 address's."""
    import ipaddress            # here: this module is on the path to the probes being attached
    ip = ipaddress.ip_address(addr)
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    raw = ip.packed
    if len(raw) == 4:
        return int.from_bytes(raw, "little")
    w = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, 16, 4)]
    return w[0] ^ w[1] ^ w[2] ^ w[3]


def tuple_hash(saddr: str, sport: int, daddr: str, dport: int) -> int:
    """The 32-bit hash of a connection: the same from either end."""
    x = (addr_word(saddr) << 16) | sport
    y = (addr_word(daddr) << 16) | dport
    lo, hi = min(x, y), max(x, y)
    h = ((lo * _K1) & MASK64) ^ ((hi * _K2) & MASK64)
    h ^= h >> 29
    return h >> 32


def keep(n: int, saddr: str, sport: int, daddr: str, dport: int) -> bool:
    """Is this connection one of the 1 in n captured?"""
    t = threshold(n)
    return not t or tuple_hash(saddr, sport, daddr, dport) < t
