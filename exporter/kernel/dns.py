"""capture.dns: the DNS programs (bpf/dns.bpf.h) and their links.

Syscall tracepoints, whatever mechanism the TCP probes use: every kernel of
nettap's range has them. The programs are loaded with the object (where the
kernel has syscall tracepoints) and attached only while ``capture.dns`` is
on, so a node that does not ask pays nothing: while on, every sendto,
sendmsg, sendmmsg, write, writev, recvfrom, recvmsg and read of the node runs
one more program, which leaves at the capture filter unless a target asks.
Reported as one probe, ``dns``.
"""
from __future__ import annotations

import logging

from exporter.kernel import libbpf
from exporter.kernel.mechanisms import DISABLED, UNSUPPORTED, ProbeState, syscall_tps, tracepoint_support

log = logging.getLogger(__name__)

PROBE = "dns"
OFF = "capture.dns is off"
# program (the fast variant's name) -> the tracepoints it is attached to.
TRACEPOINTS = {
    "dns_recv_exit": syscall_tps("sys_exit", ("recvfrom", "read", "recvmsg")),
    "dns_sendto": syscall_tps("sys_enter", ("sendto",)),
    "dns_write": syscall_tps("sys_enter", ("write",)),
    "dns_writev": syscall_tps("sys_enter", ("writev",)),
    "dns_sendmsg": syscall_tps("sys_enter", ("sendmsg",)),
    "dns_sendmmsg": syscall_tps("sys_enter", ("sendmmsg",)),
    "dns_recvfrom": syscall_tps("sys_enter", ("recvfrom",)),
    "dns_read": syscall_tps("sys_enter", ("read",)),
    "dns_recvmsg": syscall_tps("sys_enter", ("recvmsg",)),
}


def programs(variant: str) -> list:
    """The DNS programs of a variant, the return first: attached in this
    order, no receive is kept before its return can end it."""
    return list(TRACEPOINTS) if variant == "fast" else [f"{n}_compat" for n in TRACEPOINTS]


def supported() -> tuple:
    """(True, "") where the kernel has syscall tracepoints, else (False, why)."""
    ok, why = tracepoint_support()
    return (True, "") if ok else (False, why)


class DnsProbes:
    """The DNS programs' links, made and destroyed by set(); ``state`` is the
    ``dns`` probe as /metrics reports it. Not thread-safe: the daemon's
    config thread alone switches it."""

    def __init__(self, variant: str, destroy_links):
        """destroy_links: loader.destroy_links (it destroys links at once)."""
        self.variant = variant
        self._destroy = destroy_links
        ok, why = supported()
        self.state = ProbeState(PROBE, mechanism=DISABLED if ok else UNSUPPORTED, error=OFF if ok else why)
        self.loaded = ok
        self.links: list = []

    def refused(self, error: str) -> None:
        """The kernel refused the programs at load: DNS stays off, said why."""
        self.loaded = False
        self.state.mechanism, self.state.error = "none", f"the kernel refused its programs: {error}"

    def set(self, obj: int, on: bool) -> None:
        """Attach every DNS program (on) or destroy their links (off)."""
        if not self.loaded or on == bool(self.links):
            return
        if not on:
            self.detach()
            self.state.mechanism, self.state.attached, self.state.error = DISABLED, False, OFF
            return
        try:
            for name in programs(self.variant):
                prog = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
                for cat, tp in TRACEPOINTS[name.removesuffix("_compat")]:
                    self.links.append(libbpf.call_ptr("bpf_program__attach_tracepoint",
                                                      prog, cat.encode(), tp.encode()))
        except OSError as e:
            self.detach()
            self.state.mechanism, self.state.attached, self.state.error = "none", False, str(e)
            log.error("probe dns not attached: %s", e)
            return
        self.state.mechanism, self.state.attached, self.state.error = "tracepoint", True, ""
        log.info("probe dns attached by tracepoint")

    def detach(self) -> None:
        self._destroy(self.links)
        self.links = []
