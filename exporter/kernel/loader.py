"""The probe loader: open bpf/<arch>/tcp.bpf.o, choose each probe's attach
mechanism and the program variant, load, attach, and own the lifetime of
everything it made.

Before load, from what this kernel accepts (exporter/kernel/mechanisms.py's
plan): per probe the mechanism, and for the whole object the variant. The
programs not chosen get autoload switched off (libbpf-tools' way: fallbacks
are decided in user space, not with #ifdefs). A probe whose attach fails is
reported with mechanism ``none``; the others keep running.

:meth:`Probes.close` destroys every link and closes the object, so nothing
stays in the kernel: no pins are made, and links die with the process even
when it is killed.
"""
from __future__ import annotations

import errno
import logging
import os

from exporter.kernel import arch, dns, followed, gotls, ksyms, libbpf, tcp_h, tls, tlsfiles
from exporter.kernel import privileges
from exporter.kernel import programs as table
from exporter.kernel.objects import configure, destroy_links, object_maps, object_programs, open_object
from exporter.kernel.mechanisms import (CALL_PROBES, DISABLED, UNSUPPORTED, Plan, ProbeState, ensure_tracefs,
                                        plan, programs_for)
from exporter.kernel.separate import LIFECYCLE, SEPARATE, SeparateProbes, separate_programs  # noqa: F401

log = logging.getLogger(__name__)

# Plain strings and classes on this path: pathlib, dataclasses and typing would
# add ~30 ms of imports before the probes are attached.
OBJECT = "tcp.bpf.o"
OBJECT_OPEN_LOOP = "tcp_open_loop.bpf.o"      # the same for kernels without bpf_loop (bpf/emit.bpf.h)


RINGS = tcp_h.RINGS
PROBES = CALL_PROBES            # the probes a mechanism attaches (TLS: tls.PROBES, uprobes)

TRACEFS = "/sys/kernel/tracing"
KPROBE_PMU = "/sys/bus/event_source/devices/kprobe/type"


# The lifecycle programs (bpf/lifecycle.bpf.c, retransmit.bpf.c): the
# probes of one fixed mechanism, a BTF raw tracepoint
# (tp_btf: bpf/lifecycle.bpf.c says why not the classic tracepoints) or syscall
# tracepoints user space attaches them to (tcp_accept), each program tagged
# with its probe. Those of LIFECYCLE decide capture at a socket's first state
# and publish its life (states, eof, resets, destruction); reported as one
# probe, attached when all are, and the object does not load without them.
# Every other is a probe of its own (SEPARATE: separate.py).
TLS_OFF = "capture.tls is off"


def lifecycle_programs(variant: str = "fast") -> dict:
    """program name -> mechanism of the lifecycle programs of a variant."""
    return {n: table.PROGRAMS[n][table.MECH] for n in table.names(LIFECYCLE, variant=variant)}


def attached_tracepoints() -> dict:
    """program -> the tracepoints user space attaches it to
    (scripts/hold_tracepoints.py holds them all)."""
    return table.tracepoints()


def object_for(features: list) -> str:
    """The object this kernel loads: tcp.bpf.o, whose compat programs chunk
    with bpf_loop, or tcp_open_loop.bpf.o where the kernel has no bpf_loop
    (before 5.13 it refuses any program that names bpf_loop's callback)."""
    return OBJECT if any(f.name == "bpf_loop" and f.present for f in features) else OBJECT_OPEN_LOOP


def load_at_start(wanted: bool) -> bool:
    """Load the DNS (or TLS) programs with the object (Probes' dns_now,
    tls_now)? When the config asks for them, or when nettap could not load
    them later (it keeps no CAP_SYS_ADMIN after attach)."""
    return wanted or not privileges.loads_after_drop()


def records_at_start(kinds):
    """Probes' records: the record kinds whose programs a start attaches,
    where a reload can attach the others (CAP_SYS_ADMIN kept); else None:
    every program attached for good, their records still as capture.records
    says (the programs test it)."""
    return frozenset(kinds) if privileges.loads_after_drop() else None


class Probes:
    """The loaded object, its maps and links. Not thread-safe: open and
    close from one thread; the map fds it hands out may be used anywhere."""

    def __init__(self, ring_sizes: dict | None = None, mechanism: str | None = None,
                 obj_path: str | None = None, kernel_plan: Plan | None = None,
                 variant: str | None = None, dns_now: bool = True, tls_now: bool = False,
                 records=None):
        """kernel_plan: plan()'s answer, when the caller asked the kernel
        already (the CLI does it while it reads the config). dns_now=False:
        the DNS programs are loaded when capture.dns is first turned on
        (set_dns), not with the object: on the syscall tracepoints they are
        half of what the kernel verifies at start (~70 ms of ~150 here).
        tls_now=False (the default: what the tests' own loads want): the same
        for the TLS programs and capture.tls (set_tls); Go's return programs are the biggest nettap has (a start
        on 5.10 in a TCG guest: 3.1-3.9 s without them, 6.7-7.5 s with).
        records: the record kinds asked for (capture.records; None: all):
        a probe whose programs run only for others is loaded, not attached
        (set_records attaches it when a config asks)."""
        self.obj = 0
        self._keep_obj = False
        self.dns_obj = 0           # the DNS programs' own object, when loaded after the start
        self.tls_obj = 0           # the TLS programs' own object, likewise
        self.links: list = []
        self.prog_fds: dict = {}
        self.map_fds: dict = {}
        self.map_info: dict = {}   # type, key, value, max
        ensure_tracefs()
        self.plan = kernel_plan if kernel_plan is not None else plan(mechanism, variant)
        self.states = self.plan.states
        self.variant = self.plan.variant
        self.lifecycle = ProbeState(LIFECYCLE, mechanism=table.mechanisms(LIFECYCLE)[0])
        self.sep = SeparateProbes(self.plan.features, self.variant, records)
        self.separate = self.sep.states
        ok, why = tls.supported()
        self.tls_ok = ok
        self.tls_mech = tls.mechanism(self.plan.features)     # uprobe_multi (6.6+) or uprobe
        self.tls_states = {p: ProbeState(p, mechanism=DISABLED if ok else UNSUPPORTED, error=why or TLS_OFF)
                           for p in tls.PROBES + gotls.PROBES}
        self.tls: tlsfiles.TlsProbes | None = None
        self.tls_refused = dict.fromkeys(tls.REASONS, 0)     # libssl files refused, while TLS was ever on
        self.ksyms_tw = None                # struct nettap_ksyms as written: with the TIME_WAIT timer's function?
        self.forgotten: dict = {}           # obs_counters row -> entries forgotten by a detach (followed.py)
        self.tls_deferred = ok and not tls_now              # loaded at the first set_tls(True)
        self.dns = dns.DnsProbes(self.variant, self.plan.dns, destroy_links)
        self.dns.deferred = self.dns.loaded and not dns_now
        path = str(obj_path or arch.object_path(object_for(self.plan.features)))
        if not os.path.exists(path):            # say so, not the EPERM-like error libbpf gives
            raise FileNotFoundError(errno.ENOENT, "no BPF object (reinstall nettap, or set NETTAP_BPF_DIR)", path)
        self._path, self._ring_sizes = path, dict(ring_sizes or {})
        try:
            self._load(path, ring_sizes or {})
            self._collect_fds()
            self._attach()
        except BaseException:
            self.close()
            raise

    def _open(self, path: str, ring_sizes: dict, want: dict | None = None) -> None:
        self.obj = open_object(path)
        configure(self.obj, self.plan.features, self.variant,
                  self._wanted_programs() if want is None else want, ring_sizes)
        tls.prepare(self.obj, self.tls_mech)

    def _load(self, path: str, ring_sizes: dict) -> None:
        """Open, configure and load the object. Where the kernel refuses it,
        the separately reported programs (accept, socket errors) are loaded
        one by one: one the kernel refuses alone is reported unattached
        (mechanism none, with the kernel's error) and the rest loads without
        it. A refusal of anything else is nettap's failure to start."""
        self._open(path, ring_sizes)
        try:
            libbpf.call("bpf_object__load", self.obj)
            return
        except OSError as e:
            failure = e
        self._close_object()
        refused = {}
        groups = {probe: progs for probe, (progs, _m) in self.sep.programs.items()}
        if self.dns.loaded and not self.dns.deferred:
            groups[dns.PROBE] = self.dns.programs()
        for probe, progs in groups.items():
            self._open(path, ring_sizes, want=dict.fromkeys(progs, probe))
            try:
                libbpf.call("bpf_object__load", self.obj)
            except OSError as e:
                refused[probe] = e
            finally:
                self._close_object()
        if not refused:
            raise failure
        for probe, e in refused.items():
            if probe == dns.PROBE:
                self.dns.refused(str(e))
                log.error("probe dns not loaded: %s", self.dns.state.error)
                continue
            self.sep.refused(probe, e)
        self._open(path, ring_sizes)
        libbpf.call("bpf_object__load", self.obj)

    def _close_object(self) -> None:
        lb = libbpf.lib()
        if self.dns_obj:
            lb.bpf_object__close(self.dns_obj)
            self.dns_obj = 0
        # (a TLS worker stuck in the TLS programs' object: freed at exit)
        if self.tls_obj and not self._keep_obj:
            lb.bpf_object__close(self.tls_obj)
        if self.obj and not (self._keep_obj and not self.tls_obj):
            lb.bpf_object__close(self.obj)
        self.obj = self.tls_obj = 0

    # -- setup --
    def _programs(self):
        return object_programs(self.obj)

    def _maps(self):
        return object_maps(self.obj)

    def _wanted_programs(self) -> dict:
        """program name -> probe (or 'lifecycle') for every program to load."""
        want = {name: "lifecycle" for name in lifecycle_programs(self.variant)}
        want.update({prog: n for n, (progs, _m) in self.sep.programs.items() for prog in progs})
        for probe, st in self.states.items():
            if st.mechanism != "none":
                want.update({p: probe for p in programs_for(probe, st.mechanism, self.variant)})
        if self.tls_ok and not self.tls_deferred:
            want.update({p: "tls" for p in tls.programs(self.variant) + gotls.programs(self.variant)})
        if self.dns.loaded and not self.dns.deferred:
            want.update({p: dns.PROBE for p in self.dns.programs()})
        return want

    def _collect_fds(self) -> None:
        lb = libbpf.lib()
        for name, prog in self._programs():
            if lb.bpf_program__autoload(prog):
                self.prog_fds[name] = libbpf.call("bpf_program__fd", prog)
        for name, m in self._maps():
            if not lb.bpf_map__autocreate(m):
                continue
            self.map_fds[name] = libbpf.call("bpf_map__fd", m)
            self.map_info[name] = (lb.bpf_map__type(m), lb.bpf_map__key_size(m),
                                   lb.bpf_map__value_size(m), lb.bpf_map__max_entries(m))

    def _attach_one(self, name: str, mechanism: str) -> None:
        prog = libbpf.call_ptr("bpf_object__find_program_by_name", self.obj, name.encode())
        if mechanism == "tracepoint":
            for cat, tp in table.attach(name):
                self.links.append(libbpf.call_ptr("bpf_program__attach_tracepoint",
                                                  prog, cat.encode(), tp.encode()))
        else:
            self.links.append(libbpf.call_ptr("bpf_program__attach", prog))

    def _detach_from(self, first: int) -> None:
        """Destroy the links made since self.links had `first` of them."""
        destroy_links(self.links[first:])
        del self.links[first:]

    def _attach(self) -> None:
        first = len(self.links)
        try:
            for name, mechanism in lifecycle_programs(self.variant).items():
                self._attach_one(name, mechanism)
            self.lifecycle.attached = True
        except OSError as e:
            # Captured calls still flow; connections are just never closed.
            self._detach_from(first)
            self.lifecycle.error = str(e)
            log.error("lifecycle programs (%s) not attached: %s", ", ".join(lifecycle_programs()), e)
        self.sep.attach(self._attach_links)
        for probe, st in self.states.items():
            if st.mechanism == "none":
                st.error = "no mechanism accepted: " + "; ".join(f"{m}: {r}" for m, r in st.reasons.items())
                log.error("probe %s not attached: %s", probe, st.error)
                continue
            first = len(self.links)
            try:
                for name in programs_for(probe, st.mechanism, self.variant):
                    self._attach_one(name, st.mechanism)
                st.attached = True
                log.info("probe %s attached by %s", probe, st.mechanism)
            except OSError as e:
                # Undo this probe's partial attach; the others keep running.
                self._detach_from(first)
                st.error = str(e)
                st.mechanism = "none"
                log.error("probe %s not attached: %s", probe, e)

    def _attach_links(self, name: str, mechanism: str) -> list:
        """A program attached: its new links, not kept in self.links."""
        if name in ksyms.PROGRAMS and (self.ksyms_tw is None or name in ksyms.TIMEWAIT_PROGRAMS):
            self._write_ksyms(self.ksyms_tw or name in ksyms.TIMEWAIT_PROGRAMS)     # raises OSError
        first = len(self.links)
        try:
            self._attach_one(name, mechanism)
            return self.links[first:]
        except OSError:
            destroy_links(self.links[first:])     # a tracepoint of several attached before the failure
            raise
        finally:
            del self.links[first:]

    def set_records(self, records) -> None:
        """capture.records: attach the separate probes a kind of records
        needs, detach those none does (separate.py)."""
        detached = self.sep.set_records(records, self._attach_links)
        if self.ksyms_tw and not self.separate["tcp_timewait"].attached:
            self._write_ksyms(False)
        gone = followed.forget(detached, self.map_fds, self.map_info, self._path)
        # a new dict, not updated in place: scrapes iterate it from other threads
        self.forgotten = {r: self.forgotten.get(r, 0) + gone.get(r, 0) for r in {*self.forgotten, *gone}}

    def _write_ksyms(self, timewait: bool) -> None:
        """struct nettap_ksyms, its TIME_WAIT timer's function only while
        those programs are attached: tcp_state reads it to leave closing
        sockets' tuples for them and to count a TIME_WAIT socket not tied,
        which a reload that detached them must stop."""
        if timewait != self.ksyms_tw:
            ksyms.write(self.map_fds[ksyms.MAP], self.map_info[ksyms.MAP][2], timewait=timewait)
            self.ksyms_tw = timewait

    def set_tls(self, on: bool, processes=None) -> None:
        """capture.tls: attach the TLS uprobes to the libssl files and Go
        programs the targets' processes use (processes: () -> their pids;
        None: every process's, and the linker's libssl files), or detach
        them all. The programs are loaded at the first on, unless the start
        loaded them (tls_now)."""
        if not self.tls_ok:
            return
        if not on:
            if self.tls is not None:
                destroy_links(self.tls.close())
                self.tls = None
            for st in self.tls_states.values():
                st.mechanism, st.attached, st.error = DISABLED, False, TLS_OFF
            return
        if self.tls_deferred and not self._load_tls():
            return
        if self.tls is None:
            try:
                self.tls = tlsfiles.TlsProbes(self.tls_obj or self.obj, self.variant, self.tls_states, self.tls_refused,
                                              mech=self.tls_mech, map_fds=self.map_fds, processes=processes)
            except OSError as e:        # the dlopen ring's tracepoint: reported, TLS stays off
                for st in self.tls_states.values():
                    st.mechanism, st.attached, st.error = "none", False, f"the dlopen ring's tracepoints: {e}"
                log.error("TLS probes not attached: %s", e)
                return
        self.tls.processes = processes          # the targets' processes, as of this config
        self.rescan_tls()

    def set_dns(self, on: bool) -> None:
        """capture.dns: attach the DNS programs, or detach them (dns.py);
        loaded first if the start left them out (dns_now=False)."""
        if on and self.dns.deferred:
            self._load_dns()
        self.dns.set(self.dns_obj or self.obj, on)

    def _load_more(self, programs: list, probe: str) -> int:
        """Load these programs in an object of their own, opened from the
        same file and configured the same way, every map of it the loaded
        object's (bpf_map__reuse_fd: the rings, the filter, .rodata); their
        fds join prog_fds. Returns the object; raises OSError."""
        lb = libbpf.lib()
        obj = 0
        try:
            obj = open_object(self._path)
            configure(obj, self.plan.features, self.variant, dict.fromkeys(programs, probe), self._ring_sizes)
            tls.prepare(obj, self.tls_mech)
            for name, m in object_maps(obj):
                if not lb.bpf_map__autocreate(m):
                    continue
                if name not in self.map_fds:
                    raise OSError(errno.ENOENT, f"map {name} is not in the loaded object")
                libbpf.call("bpf_map__reuse_fd", m, self.map_fds[name])
            libbpf.call("bpf_object__load", obj)
            fds = {name: libbpf.call("bpf_program__fd", prog)
                   for name, prog in object_programs(obj) if lb.bpf_program__autoload(prog)}
        except OSError:
            if obj:
                lb.bpf_object__close(obj)
            raise
        self.prog_fds = {**self.prog_fds, **fds}        # a new dict: scrapes read the old one meanwhile
        log.info("probe %s: %d programs loaded", probe, len(fds))
        return obj

    def _load_dns(self) -> None:
        """The DNS programs loaded (_load_more). A refusal leaves DNS off and
        says why (DnsProbes.refused)."""
        try:
            self.dns_obj = self._load_more(self.dns.programs(), dns.PROBE)
        except OSError as e:
            self.dns.refused(str(e))
            log.error("probe dns not loaded: %s", self.dns.state.error)
        self.dns.deferred = False

    def _load_tls(self) -> bool:
        """The TLS programs loaded (_load_more). A refusal leaves TLS off,
        each TLS probe saying why; tried again at the next set_tls(True)."""
        try:
            self.tls_obj = self._load_more(tls.programs(self.variant) + gotls.programs(self.variant), "tls")
        except OSError as e:
            for st in self.tls_states.values():
                st.mechanism, st.attached, st.error = "none", False, f"the kernel refused the TLS programs: {e}"
            log.error("TLS probes not loaded: %s", e)
            return False
        self.tls_deferred = False
        return True

    def rescan_tls(self, wait: float = tls.DEADLINE + 1) -> None:
        """Attach the TLS uprobes to libssl files not seen before (processes
        started since), detach those no process maps any more, and say per
        probe whether any file carries them; done by TLS's own thread, waited
        for up to `wait` s: a file that does not answer is skipped after
        tls.DEADLINE, and holds no one else."""
        if self.tls is not None and not self.tls.scan(wait):
            log.warning("TLS: the look for libssl files goes on after %g s", wait)

    def tls_mapped(self, pids) -> None:
        """These processes mapped a libssl file (the dlopen ring): attach to
        it if it is new. Returns at once (TLS's own thread attaches)."""
        t = self.tls
        if t is not None:
            t.attach_mapped(pids)

    def tls_counts(self) -> dict:
        """nettap_tls_files*: the files attached now, refusals ever."""
        t = self.tls
        return t.counts() if t is not None else {"files": 0, "refused": dict(self.tls_refused)}

    def all_states(self) -> dict:
        """probe -> ProbeState, every probe: the call probes, the lifecycle
        (tcp_state), the lifecycle programs reported separately and TLS."""
        return {**self.states, "tcp_state": self.lifecycle, **self.separate, **self.tls_states,
                dns.PROBE: self.dns.state}

    # -- lifetime --
    def detach(self) -> None:
        """Destroy every link: no program runs, so nothing is published, after
        this; the maps stay until close(). Safe to call twice."""
        if self.tls is not None:            # and no more TLS attaches (tls_mapped) from now on
            self.links += self.tls.close()
            self._keep_obj = self.tls.obj_in_use
            self.tls = None
        self.links += self.dns.links
        self.dns.links = []
        self.links += self.sep.take_links()
        destroy_links(self.links)
        self.links = []

    def close(self) -> None:
        """Detach and close the object (frees programs and maps once no fd
        refers to them). Safe to call twice."""
        self.detach()
        self._close_object()
        self.prog_fds = {}
        self.map_fds = {}

    def __enter__(self) -> "Probes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
