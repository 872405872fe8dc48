"""The constants of bpf/tcp.h, for modules that need no numpy (the config,
the targets, the loader): importing numpy costs ~80 ms of nettap's start.
tests/unit/test_layout.py checks every one against the header."""

CHUNK_DATA = 400                               # NETTAP_CHUNK_DATA
MAX_PAYLOAD_BYTES = 164 * CHUNK_DATA           # NETTAP_MAX_CHUNKS_PER_CALL * NETTAP_CHUNK_DATA
MAX_CGROUP_LEVEL = 31                          # NETTAP_MAX_CGROUP_LEVEL
MAX_CGROUP_LEVELS = 4                          # NETTAP_MAX_CGROUP_LEVELS: distinct levels at once
PROBES = ("tcp_sendmsg", "tcp_recvmsg")        # NETTAP_PROBE_*
RINGS = ("capture_chunks", "capture_eof", "logs")  # NETTAP_RING_*
TARGET_PID, TARGET_CGROUP, TARGET_NETNS, TARGET_PORT = 1, 2, 4, 8   # NETTAP_TARGET_*
# Bytes one record of each ring takes in ring memory (8-byte header + record,
# 8-aligned): sizeof(struct nettap_chunk/eof/log) = 504, 120, 56.
STRIDES = {"capture_chunks": 512, "capture_eof": 128, "logs": 64}
