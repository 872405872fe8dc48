"""capture.dns: the DNS programs (bpf/dns.bpf.c) and their links.

The probe ``dns`` has its own mechanism, chosen as the TCP probes' are, in
the design card's order (mechanisms.plan): fentry/fexit, else
kprobe/kretprobe, on the inet sockets' send and receive functions
(their tags in bpf/dns.bpf.c), which only UDP and TCP socket calls run; else
syscall tracepoints, which every kernel of nettap's range has, and which
every sendto, sendmsg, sendmmsg, write, writev, recvfrom, recvmsg and read of
the node runs. The programs of that mechanism are attached only while
``capture.dns`` is on, so a node that does not ask pays nothing; while on, a
call leaves at the capture filter unless a target asks. nettap loads them
with the object when the config at start asks for DNS (or when it could not
load them later: without CAP_SYS_ADMIN, kept after the start), else when a
config first turns it on, in an object of their own that shares the loaded
object's maps (loader.Probes._load_dns).
"""
from __future__ import annotations

import logging

from exporter.kernel import libbpf
from exporter.kernel import programs as table
from exporter.kernel.mechanisms import DISABLED, DNS, UNSUPPORTED, ProbeState

log = logging.getLogger(__name__)

PROBE = DNS
OFF = "capture.dns is off"


def programs(variant: str, mechanism: str = "tracepoint") -> list:
    """The DNS programs of a variant and mechanism, the returns first:
    attached in this order, no receive is kept before its return can end it."""
    return table.names(PROBE, mechanism, variant)


class DnsProbes:
    """The DNS programs' links, made and destroyed by set(); ``state`` is the
    ``dns`` probe as /metrics reports it. Not thread-safe: the daemon's
    config thread alone switches it."""

    def __init__(self, variant: str, planned: ProbeState, destroy_links):
        """planned: the plan's dns probe (mechanisms.plan: the mechanism
        chosen, and why); destroy_links: loader.destroy_links."""
        self.variant = variant
        self.mechanism = planned.mechanism
        self._destroy = destroy_links
        self.loaded = self.mechanism != "none"
        self.deferred = False        # loaded at the first set(on) (loader.Probes, dns_now=False)
        why = "; ".join(f"{m}: {r}" for m, r in planned.reasons.items())
        self.state = ProbeState(PROBE, mechanism=DISABLED if self.loaded else UNSUPPORTED,
                                reasons=dict(planned.reasons), error=OFF if self.loaded else why)
        self.links: list = []

    def programs(self) -> list:
        return programs(self.variant, self.mechanism) if self.loaded else []

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
            for name in self.programs():
                prog = libbpf.call_ptr("bpf_object__find_program_by_name", obj, name.encode())
                if self.mechanism != "tracepoint":
                    self.links.append(libbpf.call_ptr("bpf_program__attach", prog))
                    continue
                for cat, tp in table.attach(name):
                    self.links.append(libbpf.call_ptr("bpf_program__attach_tracepoint",
                                                      prog, cat.encode(), tp.encode()))
        except OSError as e:
            self.detach()
            self.state.mechanism, self.state.attached, self.state.error = "none", False, str(e)
            log.error("probe dns not attached: %s", e)
            return
        self.state.mechanism, self.state.attached, self.state.error = self.mechanism, True, ""
        log.info("probe dns attached by %s", self.mechanism)

    def detach(self) -> None:
        self._destroy(self.links)
        self.links = []
