"""What this kernel accepts, asked before anything is loaded (:func:`plan`):
per probe the attach mechanism, in the order the design card gives
(fentry/fexit, then kprobe/kretprobe, then syscall tracepoints), each one
tried for real where a name in BTF is not proof; and for the whole object the
program variant, fast (Linux 6.2+) or compat (5.8+), from features.py. Also
tracefs, which libbpf reads tracepoint ids from: mounted privately when it
is not (:func:`ensure_tracefs`). exporter/kernel/loader.py loads what the
plan says."""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

from exporter.kernel import arch, features, libbpf, programs
from exporter.util.mounts import read as read_mountinfo

log = logging.getLogger(__name__)

MECHANISMS = programs.PLANNED
DNS = "dns"         # the probe of capture.dns: planned apart, loaded and attached by dns.py
# The probes attached by one of MECHANISMS, DNS's apart (the TLS probes are uprobes: tls.py).
CALL_PROBES = tuple(p for p in programs.planned() if p != DNS)

TRACEFS = "/sys/kernel/tracing"
KPROBE_PMU = "/sys/bus/event_source/devices/kprobe/type"


# func -> fentry_support's answer, asked once a process: a trampoline's attach and detach wait
# for the kernel (text patching, an RCU-tasks grace period), and plan() runs at every start
# and in the tests many times a process; what the kernel accepts does not change while it runs.
_FENTRY: dict = {}


def fentry_support(func: str, btf: int) -> tuple:
    """Load and attach, on ``func``, an fexit program that calls
    bpf_get_func_ret (Linux 5.17), as nettap's fexit programs do (btf: the
    parsed vmlinux BTF). Asked of the kernel once a process (_FENTRY).

    This is the only honest test: BTF may name the function while the
    kernel still refuses tracing programs (lockdown, LSM, or a kernel built
    without the trampoline), as it does with EPERM on nettap's CI kernel.
    """
    if func not in _FENTRY:
        _FENTRY[func] = _fentry_support(func, btf)
    return _FENTRY[func]


def _fentry_support(func: str, btf: int) -> tuple:
    lb = libbpf.lib()
    if preempt_rt():
        # Trampolines run BPF programs preemptible on PREEMPT_RT, and the
        # kernel skips a program that starts on a CPU where it is already
        # running (kernel/bpf/trampoline.c, __bpf_prog_enter_recur): a send
        # preempting another's fexit loses its return (seen on Debian's 6.1-rt).
        # kprobe and tracepoint programs run with preemption off.
        return False, "PREEMPT_RT kernel: fexit runs preempted by another task's are skipped"
    btf_id = lb.btf__find_by_name_kind(btf, func.encode(), libbpf.BTF_KIND_FUNC) if btf else -1
    if btf_id <= 0:
        return False, f"{func} not in vmlinux BTF"
    # r2 = r10; r2 += -8; call bpf_get_func_ret; r0 = 0; exit
    insns = (ctypes.c_uint64 * 5)(features._insn(0xBF, dst=2, src=10), features._insn(0x07, dst=2, imm=-8),
                                  features._insn(0x85, imm=184), features._insn(0xB7), features._insn(0x95))
    opts = libbpf.bpf_prog_load_opts(sz=ctypes.sizeof(libbpf.bpf_prog_load_opts),
                                     expected_attach_type=libbpf.BPF_TRACE_FEXIT,
                                     attach_btf_id=btf_id)
    fd = lb.bpf_prog_load(libbpf.BPF_PROG_TYPE_TRACING, b"nettap_probe", b"GPL",
                          insns, 5, ctypes.byref(opts))
    if fd < 0:
        return False, f"fexit with bpf_get_func_ret refused: {os.strerror(-fd)}"
    try:
        link = lb.bpf_raw_tracepoint_open(None, fd)
        if link < 0:
            return False, f"attach refused: {os.strerror(-link)}"
        os.close(link)
        return True, "fexit attach works"
    finally:
        os.close(fd)


def probe_fentry_support(probe: str, btf: int) -> tuple:
    """fentry for a probe's programs: every function they attach to named in
    BTF, and an fexit on the first their return attaches to attached for real
    (fentry_support)."""
    if not btf:
        return False, "no vmlinux BTF"
    lb = libbpf.lib()
    missing = [f for f in programs.functions(probe)
               if lb.btf__find_by_name_kind(btf, f.encode(), libbpf.BTF_KIND_FUNC) <= 0]
    if missing:
        return False, f"{', '.join(missing)} not in vmlinux BTF"
    return fentry_support(programs.returns_on(probe), btf)


def preempt_rt() -> bool:
    """Is this a PREEMPT_RT kernel? It says so in /sys/kernel/realtime and in
    its version string."""
    try:
        with open("/sys/kernel/realtime") as f:
            if f.read().strip() == "1":
                return True
    except OSError:
        pass
    return "PREEMPT_RT" in os.uname().version


def kprobe_support() -> tuple:
    if os.path.exists(KPROBE_PMU) or os.path.exists(f"{TRACEFS}/kprobe_events"):
        return True, "kprobe PMU present"
    return False, "kernel has no kprobes (no kprobe PMU, no kprobe_events)"


def tracepoint_support() -> tuple:
    if os.path.exists(f"{TRACEFS}/events/syscalls/sys_enter_write/id"):
        return True, "syscall tracepoints present"
    return False, f"{TRACEFS}/events/syscalls not found (tracefs not mounted, or no CONFIG_FTRACE_SYSCALLS)"


def tracefs_mounted(mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Is tracefs mounted at TRACEFS? (Asked of mountinfo: a user without
    CAP_DAC_READ_SEARCH cannot look inside it, mode 0700.)"""
    try:
        return any(m.mountpoint == TRACEFS and m.fstype == "tracefs" for m in read_mountinfo(mountinfo))
    except OSError:
        return False


def ensure_tracefs() -> None:
    """Make /sys/kernel/tracing available to this process.

    libbpf reads tracepoint ids from tracefs. When it is mounted but this
    process cannot read it (mode 0700 and no CAP_DAC_READ_SEARCH), say so.
    When it is not mounted, mount it inside a private mount namespace
    (unshare(CLONE_NEWNS) with slave propagation), so that the mount dies
    with nettap, even on kill -9, and the host's mount table is left as it was.
    """
    if os.path.isdir(f"{TRACEFS}/events"):
        return
    if tracefs_mounted():
        try:
            os.stat(f"{TRACEFS}/events")
        except PermissionError:
            raise OSError(errno.EACCES, f"tracefs at {TRACEFS} is mounted but this process may not read it "
                          "(mode 0700): nettap needs root, or CAP_DAC_READ_SEARCH, to read tracepoint ids") from None
        except OSError:
            pass                          # mounted, without events: mount a whole one below
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, MS_REC, MS_SLAVE = 0x00020000, 0x4000, 0x80000
    if threading.active_count() == 1 and libc.unshare(CLONE_NEWNS) == 0:
        if libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None) != 0:
            log.warning("tracefs: cannot make / a slave mount: %s", os.strerror(ctypes.get_errno()))
    else:
        log.warning("tracefs: no private mount namespace (%s); mounting on the host",
                    os.strerror(ctypes.get_errno()) if threading.active_count() == 1 else "threads running")
    if libc.mount(b"tracefs", TRACEFS.encode(), b"tracefs", 0, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"tracefs is not mounted at {TRACEFS} and mounting it failed: {os.strerror(err)}"
                      + (" (mounting needs root, or CAP_SYS_ADMIN)" if err == errno.EPERM else ""))


def programs_for(probe: str, mechanism: str, variant: str = "fast") -> list:
    """The programs of one probe, mechanism and variant, the returns first
    (programs.names)."""
    return programs.names(probe, mechanism, variant)


UNSUPPORTED = "unsupported"      # a probe this kernel cannot have (a tracepoint it lacks)
DISABLED = "disabled"            # a probe the config switches off (capture.tls)


class ProbeState:
    """One probe: the mechanism chosen, whether it is attached, why each
    mechanism was (not) taken, and the error if attaching failed."""

    def __init__(self, probe: str, mechanism: str = "none", attached: bool = False,
                 reasons: dict | None = None, error: str = ""):
        self.probe = probe
        self.mechanism = mechanism      # fentry | kprobe | tracepoint | none
        self.attached = attached
        self.reasons = reasons if reasons is not None else {}   # mechanism -> why (not) chosen
        self.error = error

    @property
    def reported(self) -> str:
        """nettap_probe_attached's mechanism label: the mechanism once attached;
        "unsupported" where the kernel lacks what the probe needs, "disabled"
        where the config switches it off (neither a failure:
        NettapProbeAttachFailed ignores them); else none."""
        return self.mechanism if self.attached or self.mechanism in (UNSUPPORTED, DISABLED) else "none"

    def __repr__(self) -> str:
        return (f"ProbeState({self.probe!r}, mechanism={self.mechanism!r}, attached={self.attached}, "
                f"reasons={self.reasons!r}, error={self.error!r})")


class Plan:
    """What to load on this kernel: the features found, the variant, and
    per probe the mechanism (ProbeState)."""

    def __init__(self, feats: list, variant: str, variant_why: str, states: dict, dns: ProbeState | None = None):
        self.features, self.variant, self.variant_why, self.states = feats, variant, variant_why, states
        # the DNS probe's mechanism: its own functions' (dns.py), apart from the TCP probes'
        self.dns = dns if dns is not None else ProbeState(DNS)


def plan(forced: str | None = None, variant: str | None = None) -> Plan:
    """Ask the kernel what it accepts. forced: one mechanism (the others are
    not tried); variant: 'fast' or 'compat' instead of the best. Raises
    features.Unsupported when the kernel is below nettap's floor, or, before
    asking the kernel anything, when nettap has no objects for the machine."""
    arch.target()
    kp = kprobe_support()
    tp = tracepoint_support()
    lb = libbpf.lib()
    btf = lb.btf__load_vmlinux_btf() or 0          # parsed once: ~15 ms
    states = {}
    try:
        feats = features.probe(btf)
        chosen, why = features.choose_variant(feats, variant)
        for probe in CALL_PROBES + (DNS,):
            states[probe] = _choose(ProbeState(probe), forced, {
                "fentry": lambda probe=probe: probe_fentry_support(probe, btf),
                "kprobe": lambda: kp, "tracepoint": lambda: tp})
        dns = states.pop(DNS)
    finally:
        if btf:
            lb.btf__free(btf)
    return Plan(feats, chosen, why, states, dns)


def _choose(st: ProbeState, forced: str | None, checks: dict) -> ProbeState:
    """The first of MECHANISMS (or the forced one) that checks[mechanism]()
    accepts; st.reasons says why each was (not) taken."""
    for mech in MECHANISMS:
        if forced and mech != forced:
            st.reasons[mech] = "not requested"
            continue
        ok, reason = checks[mech]()
        st.reasons[mech] = reason
        if ok:
            st.mechanism = mech
            break
    return st
