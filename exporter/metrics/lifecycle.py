"""What captured sockets did, counted in the kernel (obs_counters)."""
from __future__ import annotations

import itertools
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.kernel import tcp_h
from exporter.metrics.spec import families


def _nonzero(rows) -> list:
    """The indexes of the non-zero rows."""
    return [i for i, v in enumerate(rows) if v]


class LifecycleCollector(Collector):
    """What captured sockets did, counted in the kernel (the obs_counters
    rows, bpf/tcp.h NETTAP_OBS_*) whether or not their records found room on
    obs_events. ``read()`` returns the rows summed over CPUs (a sequence of ints).

    Bounded label sets: a state change only for the pairs seen (the kernel's
    states, at most 12 x 12), an error only for the numbers seen (their names;
    255 and above as "other"), both reset directions, every retransmission
    cause, both timers and both probes, every TIME_WAIT end and request outcome always."""

    SPECS = [
        (CounterMetricFamily, "nettap_tcp_state_changes", "TCP state changes of captured sockets.", ["from", "to"]),
        (CounterMetricFamily, "nettap_tcp_resets",
         "Resets sent and received by captured sockets.", ["direction"]),
        (CounterMetricFamily, "nettap_tcp_socket_errors",
         "Errors captured sockets reported (sock:inet_sk_error_report, Linux 5.14+), by name.", ["errno"]),
        (CounterMetricFamily, "nettap_tcp_retransmits",
         "Segments captured sockets sent again, by the recovery that sent them (rto: the retransmission "
         "timer; tlp: a tail loss probe; fast: recovery on ACKs), and SYN-ACKs sent again to captured "
         "ports (synack).", ["kind"]),
        (HistogramMetricFamily, "nettap_tcp_timer_behind_jiffies",
         "Jiffies from a captured socket's timer's slot on the wheel to when its CPU fired it "
         "(a stalled CPU, a vCPU the host stopped), by timer.", ["timer"]),
        (CounterMetricFamily, "nettap_tcp_probes",
         "Probes captured sockets' timers sent: zero-window probes (window) and keepalive probes (keepalive).",
         ["probe"]),
        (CounterMetricFamily, "nettap_tcp_timewait_sockets_made",
         "TIME_WAIT sockets of captured connections made (bpf/timewait.bpf.c).", []),
        (CounterMetricFamily, "nettap_tcp_timewait_sockets_ended",
         "TIME_WAIT sockets of captured connections ended, by cause (expired, reused by a new connection, "
         "reset, purged with their network namespace, killed otherwise; forgotten: followed when a reload "
         "detached their programs).", ["cause"]),
        (GaugeMetricFamily, "nettap_tcp_timewait_sockets",
         "TIME_WAIT sockets of captured connections alive now: made less ended.", []),
        (CounterMetricFamily, "nettap_tcp_timewait_sockets_untied",
         "TIME_WAIT sockets of captured connections not tied to their connection, so not followed "
         "(bpf/timewait.bpf.h: a softirq took the CPU's slot between their timer's start and the CLOSE).", []),
        (CounterMetricFamily, "nettap_tcp_request_sockets_made",
         "Request sockets of captured listeners made: a SYN received, a SYN-ACK sent (bpf/request.bpf.c).", []),
        (CounterMetricFamily, "nettap_tcp_request_sockets",
         "Request sockets of captured listeners ended, by outcome (established; timeout; overflow: the ACK came "
         "while the accept queue was full, then timed out; reset; closed: the listener closed; killed); and the "
         "SYNs that made none: cookie, a socket made from a SYN cookie's ACK; listen_drop, the segments the listener "
         "dropped (its sk_drops, read as it makes a request and closes): SYNs its full SYN or accept queue refused, "
         "and the segments its requests refused (a SYN sent again, an ACK held back or refused, a reset); "
         "forgotten: requests followed when a reload detached their programs.",
         ["outcome"]),
        (CounterMetricFamily, "nettap_capture_sampled_out",
         "Sockets a target matched that capture.sample_connections left out, counted as each was decided "
         "(at its birth, its connect, or its accept: not a socket older than its target).", []),
    ]
    # bpf/timer.bpf.h's buckets of behind_jiffies: 0, then below 2^b for b of 1..8
    BEHIND_LE = ("0", "1", "3", "7", "15", "31", "63", "127", "255", "+Inf")

    def __init__(self, read: Callable[[], "object"], state_names: tuple, errno_names: dict):
        """state_names: the kernel's TCP state names by number; errno_names:
        error names by number (exporter.capture.records, the JSON forms')."""
        self.read, self.state_names, self.errno_names = read, state_names, errno_names

    def describe(self) -> Iterable[Metric]:
        return families(self.SPECS)

    def collect(self) -> Iterable[Metric]:
        (states, resets, errors, retrans, behind, probes, tw_made, tw_ended, tw_alive, tw_untied, req_made,
         req_ended, sampled) = families(self.SPECS)
        rows = self.read()
        # bpf/tcp.h's blocks of rows and names of values (NETTAP_OBS_*, NETTAP_RETRANS_*, ...), generated
        block = {name: rows[first:end] for name, (first, end) in tcp_h.OBS_BLOCKS.items()}
        for i in _nonzero(block["states"]):
            old, new = divmod(i, 16)
            states.add_metric([self._state(old), self._state(new)], int(block["states"][i]))
        for d, name in ((tcp_h.DIR_EGRESS, "sent"), (tcp_h.DIR_INGRESS, "received")):
            resets.add_metric([name], int(block["resets"][d]))
        for e in _nonzero(block["errors"]):
            name = "other" if e >= 255 else self.errno_names.get(e, str(e))
            errors.add_metric([name], int(block["errors"][e]))
        for cause, name in tcp_h.NAMES["RETRANS"].items():
            retrans.add_metric([name], int(block["retrans"][cause]))
        for timer, name in tcp_h.NAMES["TIMER"].items():
            own = block["timers"][timer * 16:timer * 16 + 16]       # timer.bpf.h: 10 buckets, row 15 the sum
            counts = list(itertools.accumulate(int(n) for n in own[:10]))
            behind.add_metric([name], list(zip(self.BEHIND_LE, counts)), int(own[15]))
        for probe, name in tcp_h.NAMES["WAKEUP"].items():
            probes.add_metric([name], int(block["wakeups"][probe]))
        made = int(block["timewait"][tcp_h.TW_MADE])
        tw_made.add_metric([], made)
        ended = 0
        for cause, name in tcp_h.NAMES["TW"].items():
            if cause != tcp_h.TW_MADE:
                ended += int(block["timewait"][cause])
                tw_ended.add_metric([name], int(block["timewait"][cause]))
        tw_alive.add_metric([], max(made - ended, 0))
        tw_untied.add_metric([], int(block["timewait"][0]))     # row 0: no NETTAP_TW_* (bpf/timewait.bpf.h TW_UNTIED)
        for outcome, name in tcp_h.NAMES["REQ"].items():
            (req_made if outcome == tcp_h.REQ_MADE else req_ended).add_metric(
                [] if outcome == tcp_h.REQ_MADE else [name], int(block["requests"][outcome]))
        sampled.add_metric([], int(block["sampled"][0]))
        return [states, resets, errors, retrans, behind, probes, tw_made, tw_ended, tw_alive, tw_untied, req_made,
                req_ended, sampled]

    def _state(self, n: int) -> str:
        return self.state_names[n] if 0 < n < len(self.state_names) else str(n)
