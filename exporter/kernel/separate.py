"""The lifecycle probes reported apart from tcp_state (loader.LIFECYCLE):
tcp_accept, tcp_sk_error, the retransmission and timer probes, tcp_segment.
Each is attached on its own, so one that cannot attach stops only itself;
where the kernel lacks the feature one needs (its tag) it is not loaded and
is reported "unsupported" (not a failure). And each is attached only while
capture.records asks for a record kind its programs run for (their records=
tag: bpf/tcp.h): the others are loaded, reported "disabled", and attached by
the reload that asks for them.
"""
from __future__ import annotations

import logging

from exporter.kernel import programs as table
from exporter.kernel.mechanisms import DISABLED, UNSUPPORTED, ProbeState
from exporter.kernel.objects import destroy_links

log = logging.getLogger(__name__)

LIFECYCLE = "tcp_state"
SEPARATE = tuple(p for p in table.fixed() if p != LIFECYCLE)
RECORDS_OFF = "capture.records asks for none of its records"


def separate_programs(features: list, variant: str = "fast") -> dict:
    """probe -> (its programs, mechanism) of the separately reported
    lifecycle probes the kernel has what they need for."""
    have = {f.name for f in features if f.present}
    return {p: (table.names(p, variant=variant), table.mechanisms(p)[0])
            for p in SEPARATE if not table.needs(p) or table.needs(p) in have}


class SeparateProbes:
    """Their states (ProbeState, by probe), programs and links. Not
    thread-safe: the loader's thread only."""

    def __init__(self, features: list, variant: str, records=None):
        """records: the record kinds asked for (None: all)."""
        self.programs = separate_programs(features, variant)     # the loadable: probe -> (programs, mechanism)
        self.states = {}
        for n in SEPARATE:
            if n in self.programs:
                self.states[n] = ProbeState(n, mechanism=self.programs[n][1])
                continue
            needs = table.needs(n)
            since = next((f.since for f in features if f.name == needs), "")
            self.states[n] = ProbeState(n, mechanism=UNSUPPORTED, error=f"this kernel has no {needs} (Linux {since}+)")
        self.records = None if records is None else frozenset(records)
        self.links: dict = {}            # probe -> its links

    def refused(self, probe: str, e: OSError) -> None:
        """The kernel refused this probe's programs at load: reported, never tried again."""
        del self.programs[probe]
        st = self.states[probe]
        st.mechanism, st.error = "none", f"the kernel refused its program: {e}"
        log.error("probe %s not loaded: %s", probe, st.error)

    def wanted(self, probe: str) -> bool:
        kinds = table.records(probe)
        return kinds is None or self.records is None or bool(kinds & self.records)

    def attach(self, attach_one) -> None:
        """Attach every loaded probe the records ask for; attach_one(program,
        mechanism) -> its link (raises OSError)."""
        for name, st in self.states.items():
            if st.mechanism == UNSUPPORTED:
                log.info("probe %s not attached: %s", name, st.error)
            elif name in self.programs:         # (refused at load: said there)
                self._attach(name, attach_one)

    def _attach(self, name: str, attach_one) -> None:
        st = self.states[name]
        progs, mech = self.programs[name]
        if not self.wanted(name):
            st.mechanism, st.attached, st.error = DISABLED, False, RECORDS_OFF
            return
        links: list = []
        try:
            for prog in progs:
                links.extend(attach_one(prog, mech))
        except OSError as e:
            destroy_links(links)
            del self.programs[name]             # not tried again
            st.mechanism, st.attached, st.error = "none", False, str(e)
            log.error("probe %s not attached: %s", name, e)
            return
        st.mechanism, st.attached, st.error = mech, True, ""
        self.links[name] = links

    def set_records(self, records, attach_one) -> list:
        """capture.records: attach the probes a kind of records needs, detach
        those none does; returns the probes detached."""
        self.records = None if records is None else frozenset(records)
        detached = []
        for name in list(self.programs):
            st, wanted = self.states[name], self.wanted(name)
            if wanted and not st.attached:
                self._attach(name, attach_one)
            elif not wanted and st.attached:
                destroy_links(self.links.pop(name, []))
                st.mechanism, st.attached, st.error = DISABLED, False, RECORDS_OFF
                detached.append(name)
        return detached

    def take_links(self) -> list:
        """Every link, handed over to be destroyed (the probes stay as reported)."""
        out = [link for links in self.links.values() for link in links]
        self.links = {}
        return out
