"""What a thread leaves of its captured calls (bpf/emit.bpf.h, bpf/lifecycle.bpf.c):
its count in its slot of inflight_slots from a kept entry to the return, and
the compat programs' entry in inflight_compat, kept between its calls where
the kernel's hash maps allocate at run time (bpf_mem_alloc, Linux 6.1) and
removed at each return where they are preallocated; both go when the thread
ends (inflight_exit on sched:sched_process_exit), even inside a call."""
import os
import signal
import socket
import subprocess
import sys
import threading

from conftest import Run, compat_plan_without
from exporter.kernel import features, maps
from procs import wait_for
from test_capture import inflight_slots
from traffic import Server


def _entry(run, pid: int, tid: int) -> bytes | None:
    fd = run.app.probes.map_fds["inflight_compat"]
    return maps.lookup(fd, ((pid << 32) | tid).to_bytes(8, "little"), run.app.probes.map_info["inflight_compat"][2])


def _compat_thread_entry(tmp_path, kp) -> None:
    """A thread's captured sends, then its end: its entry is there between
    its calls where the plan keeps it, gone where it does not, and gone once
    the thread has ended."""
    keep = features.runtime_alloc_ok(kp.features)
    srv = Server()
    run = Run(tmp_path, {"captures": [{"port": srv.port}]}, kernel_plan=kp)
    try:
        sent, leave, tid = threading.Event(), threading.Event(), []

        def sender():
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                for _ in range(3):
                    s.sendall(b"x" * 64)
                tid.append(threading.get_native_id())
                sent.set()
                leave.wait(30)

        t = threading.Thread(target=sender)
        t.start()
        assert sent.wait(30)
        assert run.counters()["tcp_sendmsg"]["returns"] >= 3
        assert (_entry(run, os.getpid(), tid[0]) is not None) == keep, f"kept between calls: {keep}"
        leave.set()
        t.join(30)
        wait_for(lambda: _entry(run, os.getpid(), tid[0]) is None, 10, what="the ended thread's entry gone")
        srv.wait_received(1)
        assert sum(inflight_slots(run)) == 0
    finally:
        run.app.close()


def test_a_compat_threads_entry_is_kept_where_the_kernel_allocates_and_goes_with_the_thread(tmp_path):
    _compat_thread_entry(tmp_path, compat_plan_without())


def test_a_compat_threads_entry_goes_at_each_return_where_maps_are_preallocated(tmp_path):
    # Before Linux 6.1 the hash is preallocated (4,096 entries for the threads
    # inside a call at once): an idle thread must not hold one. Tell the
    # loader bpf_mem_alloc is missing, so every kernel runs that path.
    kp = compat_plan_without("bpf_mem_alloc")
    assert features.kernel_settings(kp.features)[12:16] == bytes(4)
    _compat_thread_entry(tmp_path, kp)


def _slot(tid: int) -> int:
    """bpf/maps.bpf.h thread_slot: the slot of a thread id."""
    return (((tid & 63) << 4) + ((tid >> 6) & 15)) & 1023


def _count_in_slot(run, tid: int) -> None:
    """One more call in flight in tid's slot, as inflight_hold counts it."""
    probes = run.app.probes
    name = next(n for n in probes.map_fds if n.endswith(".bss.inflight"))
    fd, size = probes.map_fds[name], probes.map_info[name][2]
    raw = bytearray(maps.lookup(fd, bytes(4), size))
    i = _slot(tid) * 4
    raw[i:i + 4] = (int.from_bytes(raw[i:i + 4], "little") + 1).to_bytes(4, "little")
    maps.update(fd, bytes(4), bytes(raw))


def test_a_thread_ended_inside_a_captured_call_leaves_no_call_in_flight(nettap_run, mode):
    """A call whose return the kernel never ran (a kretprobe beyond its
    maxactive) leaves its state valid and its thread's slot counting it; when
    that thread ends, inflight_exit must clear both, or every return of the
    threads sharing the slot goes on looking for a call. The state is written
    as an entry leaves it (valid, counted), into the variant's own map: the
    task storage through a pidfd, the compat hash by pid_tgid."""
    run = nettap_run({"captures": [{"port": 1}]})
    probes = run.app.probes
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = os.pidfd_open(child.pid)
    try:
        assert sum(inflight_slots(run)) == 0
        name = "inflight_calls" if probes.variant == "fast" else "inflight_compat"
        fd, size = probes.map_fds[name], probes.map_info[name][2]
        key = pidfd.to_bytes(4, "little") if probes.variant == "fast" else \
            ((child.pid << 32) | child.pid).to_bytes(8, "little")
        value = bytearray(size)
        value[24:28] = (1).to_bytes(4, "little")             # struct inflight: valid
        maps.update(fd, key, bytes(value))
        _count_in_slot(run, child.pid)
        assert sum(inflight_slots(run)) == 1
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: sum(inflight_slots(run)) == 0, 10, what="the ended thread's call no longer in flight")
        if probes.variant == "compat":
            assert maps.lookup(fd, key, size) is None
    finally:
        child.kill()
        child.wait()
        os.close(pidfd)
