"""The probe loader: open bpf/tcp.bpf.o, choose each probe's attach
mechanism and the program variant, load, attach, and own the lifetime of
everything it made.

Before load, from what this kernel accepts (:func:`plan`): per probe the
mechanism, in the order the design card gives (fentry/fexit, then
kprobe/kretprobe, then syscall tracepoints), and for the whole object the
variant, fast (Linux 6.2+) or compat (5.8+), from exporter/kernel/features.py. The
programs not chosen get autoload switched off (libbpf-tools' way: fallbacks
are decided in user space, not with #ifdefs). A probe whose attach fails is
reported with mechanism ``none``; the others keep running.

:meth:`Probes.close` destroys every link and closes the object, so nothing
stays in the kernel: no pins are made, and links die with the process even
when it is killed.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from exporter.kernel import features, libbpf
from exporter.util.mounts import read as read_mountinfo

log = logging.getLogger(__name__)

# Plain strings and classes on this path: pathlib, dataclasses and typing would
# add ~30 ms of imports before the probes are attached.
OBJECT = "tcp.bpf.o"


def _bpf_dir() -> str:
    """$NETTAP_BPF_DIR, else the objects shipped inside the installed package
    (pip install . copies bpf/*.bpf.o to exporter/bpf), else the checkout's bpf/."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # exporter/
    packaged = os.path.join(package, "bpf")
    if os.path.exists(os.path.join(packaged, OBJECT)):
        return packaged
    return os.path.join(os.path.dirname(package), "bpf")


BPF_DIR = os.environ.get("NETTAP_BPF_DIR") or _bpf_dir()

PROBES = ("tcp_sendmsg", "tcp_recvmsg")
RINGS = ("capture_chunks", "capture_eof", "logs")
MECHANISMS = ("fentry", "kprobe", "tracepoint")

TRACEFS = "/sys/kernel/tracing"
KPROBE_PMU = "/sys/bus/event_source/devices/kprobe/type"


def _syscall_tps(prefix: str, calls: tuple) -> list:
    return [("syscalls", f"{prefix}_{c}") for c in calls]


# program name -> tracepoints it is attached to (one program may serve several).
_TP_PLAN: dict = {
    "tcp_sendmsg": {
        "tcp_sendmsg_enter": _syscall_tps("sys_enter", ("write", "sendto")),
        "tcp_sendmsg_enter_iov": _syscall_tps("sys_enter", ("writev",)),
        "tcp_sendmsg_enter_msg": _syscall_tps("sys_enter", ("sendmsg",)),
        "tcp_sendmsg_exit": _syscall_tps("sys_exit", ("write", "sendto", "writev", "sendmsg")),
    },
    "tcp_recvmsg": {
        "tcp_recvmsg_enter": _syscall_tps("sys_enter", ("read", "recvfrom")),
        "tcp_recvmsg_enter_iov": _syscall_tps("sys_enter", ("readv",)),
        "tcp_recvmsg_enter_msg": _syscall_tps("sys_enter", ("recvmsg",)),
        "tcp_recvmsg_exit": _syscall_tps("sys_exit", ("read", "recvfrom", "readv", "recvmsg")),
    },
}
# The lifecycle programs, BTF raw tracepoints attached by their SEC
# (bpf/tcp.bpf.c says why not the classic tracepoints): tcp_state on
# sock:inet_sock_set_state publishes a connection's eof at TCP_CLOSE;
# tcp_destroy on tcp:tcp_destroy_sock publishes what a skipped tcp_state run
# left and removes every entry with its socket. Reported as one probe,
# "tcp_state", attached when both are.
LIFECYCLE = {"tcp_state": "tp_btf", "tcp_destroy": "tp_btf"}
_TRACEPOINTS = {prog: tps for plan in _TP_PLAN.values() for prog, tps in plan.items()}


def programs_for(probe: str, mechanism: str, variant: str = "fast") -> list:
    """The programs of one probe, mechanism and variant (bpf/entry_*.bpf.h:
    the compat variant's names end in _compat)."""
    if mechanism == "tracepoint":
        names = sorted(_TP_PLAN[probe], key=lambda n: "_exit" not in n)
    else:
        suffix = {"fentry": ("fexit", "fentry"), "kprobe": ("kretprobe", "kprobe")}[mechanism]
        names = [f"{probe}_{s}" for s in suffix]
    # Returns first: attached in this order, no call can enter captured and
    # return before its return program is there (its state would go stale).
    return names if variant == "fast" else [f"{n}_compat" for n in names]


BPF_MAP_TYPE_HASH = 1
# max_entries of maps that must be preallocated before Linux 6.1 (features.py:
# bpf_mem_alloc): threads inside a captured call at once; 4096 x ~650 B.
PREALLOC_MAX = {"inflight_compat": 4096}
# Preallocated on every kernel: the connection table gains an entry per
# captured connection, at connection rate and in softirq, where Linux 6.1's
# bpf_mem_alloc can fail while its per-CPU cache waits for an irq_work refill
# (the 6.1 guest of the kernel matrix lost 2-4 of 2,000 connections of a
# storm: no entry, so no eof). A preallocated table fails only when full.
ALWAYS_PREALLOC = ("capture_conns",)

# Maps only one variant's programs use: not created for the other (task
# storage does not exist before Linux 5.11).
VARIANT_MAPS = {"fast": ("inflight_calls",), "compat": ("inflight_compat", "inflight_zero", "conn_id_seq")}


# ---- what the kernel accepts ---------------------------------------------

def fentry_support(func: str, btf: int) -> tuple:
    """Load and attach, on ``func``, an fexit program that calls
    bpf_get_func_ret (Linux 5.17), as nettap's fexit programs do (btf: the
    parsed vmlinux BTF).

    This is the only honest test: BTF may name the function while the
    kernel still refuses tracing programs (lockdown, LSM, or a kernel built
    without the trampoline), as it does with EPERM on nettap's CI kernel.
    """
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

    def __repr__(self) -> str:
        return (f"ProbeState({self.probe!r}, mechanism={self.mechanism!r}, attached={self.attached}, "
                f"reasons={self.reasons!r}, error={self.error!r})")


class Plan:
    """What to load on this kernel: the features found, the variant, and
    per probe the mechanism (ProbeState)."""

    def __init__(self, feats: list, variant: str, variant_why: str, states: dict):
        self.features, self.variant, self.variant_why, self.states = feats, variant, variant_why, states


def plan(forced: str | None = None, variant: str | None = None) -> Plan:
    """Ask the kernel what it accepts. forced: one mechanism (the others are
    not tried); variant: 'fast' or 'compat' instead of the best. Raises
    features.Unsupported when the kernel is below nettap's floor."""
    kp = kprobe_support()
    tp = tracepoint_support()
    lb = libbpf.lib()
    btf = lb.btf__load_vmlinux_btf() or 0          # parsed once: ~15 ms
    states = {}
    try:
        feats = features.probe(btf)
        chosen, why = features.choose_variant(feats, variant)
        for probe in PROBES:
            st = ProbeState(probe)
            checks = {"fentry": lambda probe=probe: fentry_support(probe, btf) if btf else (False, "no vmlinux BTF"),
                      "kprobe": lambda: kp, "tracepoint": lambda: tp}
            for mech in MECHANISMS:
                if forced and mech != forced:
                    st.reasons[mech] = "not requested"
                    continue
                ok, reason = checks[mech]()
                st.reasons[mech] = reason
                if ok:
                    st.mechanism = mech
                    break
            states[probe] = st
    finally:
        if btf:
            lb.btf__free(btf)
    return Plan(feats, chosen, why, states)


def object_programs(obj: int):
    """(name, bpf_program *) of every program of an opened object."""
    prog = libbpf.lib().bpf_object__next_program(obj, None)
    while prog:
        yield libbpf.name_of("bpf_program__name", prog), prog
        prog = libbpf.lib().bpf_object__next_program(obj, prog)


def object_maps(obj: int):
    """(name, bpf_map *) of every map of an opened object."""
    m = libbpf.lib().bpf_object__next_map(obj, None)
    while m:
        yield libbpf.name_of("bpf_map__name", m), m
        m = libbpf.lib().bpf_object__next_map(obj, m)


def configure(obj: int, feats: list, variant: str, want, ring_sizes: dict) -> None:
    """Before load: autoload only the programs in want, create only the
    variant's maps, preallocate hash maps where the kernel needs it, and
    write what the kernel offers into .rodata.nettap."""
    lb = libbpf.lib()
    for name, prog in object_programs(obj):
        libbpf.call("bpf_program__set_autoload", prog, name in want)
    unused = {m for v, maps in VARIANT_MAPS.items() if v != variant for m in maps}
    settings = features.kernel_settings(feats)
    prealloc = not features.runtime_alloc_ok(feats)
    for name, m in object_maps(obj):
        if (prealloc or name in ALWAYS_PREALLOC) and lb.bpf_map__type(m) == BPF_MAP_TYPE_HASH \
                and lb.bpf_map__map_flags(m) & 1:
            # Before 6.1: preallocate (see features.py), and keep the
            # per-thread call table small, as it is then paid in full.
            libbpf.call("bpf_map__set_map_flags", m, lb.bpf_map__map_flags(m) & ~1)
            if name in PREALLOC_MAX:
                libbpf.call("bpf_map__set_max_entries", m, PREALLOC_MAX[name])
        if name in unused:
            libbpf.call("bpf_map__set_autocreate", m, False)
        if name.endswith(".rodata.nettap"):
            libbpf.call("bpf_map__set_initial_value", m, settings, len(settings))
        if name in ring_sizes:
            libbpf.call("bpf_map__set_max_entries", m, ring_sizes[name])


def destroy_links(links) -> None:
    """Destroy libbpf links, all at once.

    Detaching waits for the kernel: a tracepoint's perf event waits out an
    RCU grace period as it unregisters (kernel/trace/trace_event_perf.c:
    perf_trace_event_unreg -> tracepoint_synchronize_unregister), a
    kprobe's and a trampoline's alike. One after another, 18 links took
    0.6 s here (~10x that in an emulated guest); destroyed from a thread
    each, the waits overlap: 0.065 s. ctypes releases the interpreter lock
    around each call, and each link is its own (libbpf shares no state
    between them)."""
    destroy = libbpf.lib().bpf_link__destroy
    if len(links) < 2:
        for link in links:
            destroy(link)
        return
    threads = [threading.Thread(target=destroy, args=(link,), name="nettap-detach") for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Probes:
    """The loaded object, its maps and links. Not thread-safe: open and
    close from one thread; the map fds it hands out may be used anywhere."""

    def __init__(self, ring_sizes: dict | None = None, mechanism: str | None = None,
                 obj_path: str | None = None, kernel_plan: Plan | None = None,
                 variant: str | None = None):
        """kernel_plan: plan()'s answer, when the caller asked the kernel
        already (the CLI does it while it reads the config)."""
        self.obj = 0
        self.links: list = []
        self.prog_fds: dict = {}
        self.map_fds: dict = {}
        self.map_info: dict = {}   # type, key, value, max
        ensure_tracefs()
        self.plan = kernel_plan if kernel_plan is not None else plan(mechanism, variant)
        self.states = self.plan.states
        self.variant = self.plan.variant
        self.lifecycle = ProbeState("tcp_state", mechanism=LIFECYCLE["tcp_state"])
        path = str(obj_path or os.path.join(BPF_DIR, OBJECT))
        if not os.path.exists(path):            # say so, not the EPERM-like error libbpf gives
            raise FileNotFoundError(errno.ENOENT, "no BPF object (reinstall nettap, or set NETTAP_BPF_DIR)", path)
        try:
            self.obj = libbpf.call_ptr("bpf_object__open_file", path.encode(), None)
            self._configure(ring_sizes or {})
            libbpf.call("bpf_object__load", self.obj)
            self._collect_fds()
            self._attach()
        except BaseException:
            self.close()
            raise

    # -- setup --
    def _programs(self):
        return object_programs(self.obj)

    def _maps(self):
        return object_maps(self.obj)

    def _wanted_programs(self) -> dict:
        """program name -> probe (or 'lifecycle') for every program to load."""
        want = {name: "lifecycle" for name in LIFECYCLE}
        for probe, st in self.states.items():
            if st.mechanism != "none":
                want.update({p: probe for p in programs_for(probe, st.mechanism, self.variant)})
        return want

    def _configure(self, ring_sizes: dict) -> None:
        configure(self.obj, self.plan.features, self.variant, self._wanted_programs(), ring_sizes)

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
            for cat, tp in _TRACEPOINTS[name.removesuffix("_compat")]:
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
            for name, mechanism in LIFECYCLE.items():
                self._attach_one(name, mechanism)
            self.lifecycle.attached = True
        except OSError as e:
            # Captured calls still flow; connections are just never closed.
            self._detach_from(first)
            self.lifecycle.error = str(e)
            log.error("lifecycle programs (%s) not attached: %s", ", ".join(LIFECYCLE), e)
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

    # -- lifetime --
    def detach(self) -> None:
        """Destroy every link: no program runs, so nothing is published, after
        this; the maps stay until close(). Safe to call twice."""
        destroy_links(self.links)
        self.links = []

    def close(self) -> None:
        """Detach and close the object (frees programs and maps once no fd
        refers to them). Safe to call twice."""
        self.detach()
        lb = libbpf.lib()
        if self.obj:
            lb.bpf_object__close(self.obj)
            self.obj = 0
        self.prog_fds = {}
        self.map_fds = {}

    def __enter__(self) -> "Probes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
