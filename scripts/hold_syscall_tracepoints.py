#!/usr/bin/python3
"""Hold the kernel's syscall tracepoints enabled while the kernel tests run in
an emulated guest: scripts/hold_syscall_tracepoints.py & ... ; kill $!

Why: attaching the first syscall tracepoint (or detaching the last) makes the
kernel rewrite its syscall entry and exit code (the sys_enter/sys_exit jump
labels: int3 first, then the new instruction). Under qemu's multi-threaded
TCG a vCPU can keep meeting the int3 after it was removed, and Linux 5.10's
int3 handler retries such a trap forever: both vCPUs of a 5.10 guest sat in
"soft lockup" at that jump label, and the run wedged, after a few dozen
tracepoint attach/detach cycles. With one perf event held on getppid's
syscall tracepoints (no BPF; getppid is not what any test captures), the
tests' tracepoints are never the first or the last, so that code is never
rewritten while they run. Exits on SIGTERM; the events go with the process.
"""
import ctypes
import os
import signal
import sys

TRACEFS = "/sys/kernel/tracing/events"
# (tracepoint, required): the syscall ones the run wedged on; the lifecycle
# programs' own tracepoints too, where the kernel has them (their jump labels
# are rewritten the same way, on a path taken less often)
HELD = [("syscalls/sys_enter_getppid", True), ("syscalls/sys_exit_getppid", True),
        ("sock/inet_sock_set_state", False), ("tcp/tcp_destroy_sock", False),
        ("tcp/tcp_send_reset", False), ("tcp/tcp_receive_reset", False), ("sock/inet_sk_error_report", False)]
PERF_TYPE_TRACEPOINT = 2
SYS_perf_event_open = 298          # x86-64


class PerfEventAttr(ctypes.Structure):
    """The leading fields of ``struct perf_event_attr`` (include/uapi/linux/perf_event.h);
    size says how many the kernel reads (PERF_ATTR_SIZE_VER0 = 64)."""
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64)]


def open_tracepoint(libc, name: str, cpu: int) -> int:
    with open(f"{TRACEFS}/{name}/id") as f:
        attr = PerfEventAttr(type=PERF_TYPE_TRACEPOINT, size=ctypes.sizeof(PerfEventAttr),
                             config=int(f.read()), sample_period=1)
    fd = libc.syscall(SYS_perf_event_open, ctypes.byref(attr), -1, cpu, -1, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"perf_event_open({name}, cpu {cpu})")
    return fd


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    try:
        # one CPU's event is enough: registering it enables the tracepoint for all
        for name, required in HELD:
            if required or os.path.exists(f"{TRACEFS}/{name}/id"):
                fds.append(open_tracepoint(libc, name, 0))
    except OSError as e:
        print(f"hold_syscall_tracepoints: {e}: not held", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"hold_syscall_tracepoints: holding {len(fds)} tracepoints", file=sys.stderr, flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
