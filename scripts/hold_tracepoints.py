#!/usr/bin/env python3
"""Hold every tracepoint nettap attaches to registered while the tests run:
.venv/bin/python scripts/hold_tracepoints.py & ... ; kill $!
(scripts/test.sh on the host; scripts/kernel_matrix.py in each guest).

It opens one perf event per tracepoint, disabled (no BPF, nothing recorded:
a call through the tracepoint finds no event to fill), so the tests'
programs are never the first on a tracepoint, nor the last. Two reasons:

- Time. The last perf event leaving a tracepoint waits out an RCU grace
  period (kernel/trace/trace_event_perf.c: perf_trace_event_unreg ->
  tracepoint_synchronize_unregister), under event_mutex, so one after
  another: closing a nettap took 0.7 s on Linux 6.18 (18 syscall-tracepoint
  links, ~40 ms each), and the tests close hundreds. Held, 0.07 s. (A
  nettap on a node pays it at stop and at a reload that detaches; the tests
  pay it in test_sink_stop's and test_dns's own checks of those.)
- Emulated guests. Registering the first probe of a tracepoint (or removing
  the last) rewrites its jump label in kernel text: int3 first, then the new
  instruction. Under qemu's multi-threaded TCG a vCPU can keep meeting the
  int3 after it was removed: Linux 5.10's int3 handler retries such a trap
  forever (both vCPUs of a 5.10 guest sat in "soft lockup" at the syscall
  labels), and a 6.12 guest died of an "Oops: int3" in call_timer_fn, on
  timer_expire_entry's. Held, no label is rewritten while the tests run.
  A raw tracepoint (tp_btf) also calls its one probe directly, through a
  static call that is rewritten whenever it gains a second probe or loses
  it (tracepoint_update_call): a 6.12 guest died of an "Oops: int3" at
  sched_process_exit's in do_exit, nettap's inflight_exit coming and going
  beside the held perf event. So each tracepoint nettap attaches a BPF
  raw tracepoint to holds a second probe too, an empty raw-tracepoint
  program: with two, its call goes through the probe iterator whatever
  nettap attaches, and is never rewritten.

The tracepoints are what the BPF object's programs name in their sections
and what the loader and the DNS probe attach one program to (so a new probe
is held without an edit here), plus getppid's syscall pair, which keep the
syscall entry and exit labels on between tests. tracefs (for the ids) is
mounted privately when it is not mounted. Exits on SIGTERM; the events go
with the process.
"""
import ctypes
import glob
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exporter.kernel import arch, libbpf, loader, mechanisms  # noqa: E402

EVENTS = f"{mechanisms.TRACEFS}/events"
PERF_TYPE_TRACEPOINT = 2
DISABLED = 1                       # perf_event_attr.flags bit 0


class PerfEventAttr(ctypes.Structure):
    """The leading fields of ``struct perf_event_attr`` (include/uapi/linux/perf_event.h);
    size says how many the kernel reads (PERF_ATTR_SIZE_VER0 = 64)."""
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64)]


def tracepoints(obj_path: str) -> set:
    """Names ("category/event", or a bare event for tp_btf/raw_tp sections)
    of every tracepoint nettap may attach to."""
    names = {"syscalls/sys_enter_getppid", "syscalls/sys_exit_getppid"}
    for tps in loader.attached_tracepoints().values():
        names.update(f"{cat}/{tp}" for cat, tp in tps)
    obj = libbpf.call_ptr("bpf_object__open_file", obj_path.encode(), None)
    try:
        for _name, prog in loader.object_programs(obj):
            kind, _, where = libbpf.name_of("bpf_program__section_name", prog).partition("/")
            if kind in ("tracepoint", "tp", "tp_btf", "raw_tp", "raw_tracepoint") and where:
                names.add(where)
    finally:
        libbpf.lib().bpf_object__close(obj)
    return names


def event_id(name: str) -> int | None:
    """The tracefs id of "category/event" or of a bare event name, if the kernel has it."""
    paths = [f"{EVENTS}/{name}/id"] if "/" in name else glob.glob(f"{EVENTS}/*/{name}/id")
    for p in paths:
        try:
            with open(p) as f:
                return int(f.read())
        except OSError:
            pass
    return None


BPF_PROG_TYPE_RAW_TRACEPOINT = 17
EMPTY = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)    # r0 = 0; exit


def hold_raw(name: str, prog: list) -> int:
    """A second probe on the raw tracepoint name: the empty program (loaded
    once, into prog[0]) attached there."""
    if not prog:
        prog.append(libbpf.call("bpf_prog_load", BPF_PROG_TYPE_RAW_TRACEPOINT, b"nettap_hold", b"GPL",
                                EMPTY, 2, None))
    fd = libbpf.lib().bpf_raw_tracepoint_open(name.encode(), prog[0])
    if fd < 0:
        raise OSError(-fd, f"bpf_raw_tracepoint_open({name})")
    return fd


def open_disabled(libc, config: int) -> int:
    attr = PerfEventAttr(type=PERF_TYPE_TRACEPOINT, size=ctypes.sizeof(PerfEventAttr), config=config,
                         sample_period=1, flags=DISABLED)
    # one CPU's event registers the tracepoint for all
    return libc.syscall(arch.syscall_nr("perf_event_open"), ctypes.byref(attr), -1, 0, -1, 0)


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fds, missing, prog, raw, not_raw = [], [], [], 0, []
    try:
        mechanisms.ensure_tracefs()
        for name in sorted(tracepoints(arch.object_path(loader.OBJECT))):
            config = event_id(name)
            if config is None:
                missing.append(name)         # a tracepoint this kernel lacks: nettap cannot attach it either
                continue
            fd = open_disabled(libc, config)
            if fd < 0:
                raise OSError(ctypes.get_errno(), f"perf_event_open({name})")
            fds.append(fd)
            if "/" not in name:              # a tp_btf or raw_tp section's: a raw tracepoint's probe too
                try:
                    fds.append(hold_raw(name, prog))
                    raw += 1
                except OSError as e:         # its perf event still holds the label
                    not_raw.append(f"{name} ({e.strerror})")
    except OSError as e:
        print(f"hold_tracepoints: {e}: not held", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"hold_tracepoints: holding {len(fds) - raw} tracepoints ({raw} with a raw tracepoint's probe too)"
          + (f" (not in this kernel: {', '.join(missing)})" if missing else "")
          + (f" (no raw tracepoint probe on: {', '.join(not_raw)})" if not_raw else ""), file=sys.stderr, flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
