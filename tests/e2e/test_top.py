"""End-to-end: `nettap top` in a real terminal (tmux), over a real nettap
under real traffic; the kernel's BPF statistics held only while it runs."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from exporter.kernel.bpfstats import KernelStatsProbe
from procs import ROOT, Nettap, free_port, held_programs, stats_held_elsewhere, wait_for
from traffic import Server, send_messages

pytestmark = pytest.mark.e2e
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(.+?)\s+([\d,.-]+)\s+([\d,.-]+)\s+([\d.-]+)\s*$")


def kernel_stats_on() -> bool:
    probe = KernelStatsProbe()
    try:
        return probe.on()
    finally:
        probe.close()


def stats_off_but_for_others() -> None:
    """The kernel's statistics are on exactly when another process holds them on
    (other jobs on this machine switch theirs at any time: asked until both agree)."""
    wait_for(lambda: kernel_stats_on() == stats_held_elsewhere(), timeout=10, what="stats as others hold them")
    assert open("/proc/sys/kernel/bpf_stats_enabled").read().strip() == "0" or stats_held_elsewhere()


def stats_fds(pid: int) -> int:
    fds = os.listdir(f"/proc/{pid}/fd")
    return sum(1 for fd in fds if os.path.exists(f"/proc/{pid}/fd/{fd}")
               and os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:bpf-stats")


def sorted_view(t, header: str, key, reverse: bool) -> list:
    """The view's column (key of each row: None left out) once one screen
    shows header and its rows in that order: a screen read while the view
    redraws holds old rows under the new header."""
    def shown():
        screen = t.screen()
        col = [key(r) for r in rows(screen) if key(r) is not None]
        return header in screen and col and col == sorted(col, reverse=reverse) and col
    return wait_for(shown, timeout=5, what=f"the rows sorted under {header}")


def rows(screen: str) -> list:
    """(id, name, type, owner, runs/s or None) of the programs table."""
    out = []
    for line in screen.splitlines():
        m = ROW.match(line)
        if m:
            runs = m.group(5)
            out.append((int(m.group(1)), m.group(2), m.group(3), m.group(4),
                        None if runs == "-" else float(runs.replace(",", ""))))
    return out


def bpftool_names(ids) -> dict:
    progs = json.loads(subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                                      check=True).stdout)
    return {p["id"]: p.get("name", "") for p in progs if p["id"] in ids}


class Traffic:
    """Sends to the server until stopped: nettap's programs run all along."""

    def __init__(self, port: int):
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.t.start()

    def _run(self, port):
        while not self.stop.is_set():
            send_messages(port, 20, 100)
            time.sleep(0.05)

    def close(self):
        self.stop.set()
        self.t.join(10)


@pytest.fixture
def loaded(tmp_path):
    """A nettap capturing a server's port (statistics off in its config), under traffic."""
    srv = Server()
    n = Nettap(tmp_path, {"captures": [{"port": srv.port}], "diagnostics": {"bpfStats": {"enabled": False}}})
    t = Traffic(srv.port)
    yield n
    t.close()
    n.stop()
    srv.close()


class Tmux:
    def __init__(self, cmd: str):
        self.name = f"nettap-top-{os.getpid()}-{free_port()}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "200", "-y", "150", "-c", str(ROOT),
                        f"{cmd}; echo nettap-top-exit=$?; sleep 600"], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True,
                              check=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def top_pid(self) -> int:
        """The nettap top process: the pane's shell's child."""
        sh = int(subprocess.run(["tmux", "display-message", "-p", "-t", self.name, "#{pane_pid}"],
                                capture_output=True, text=True, check=True).stdout)
        children = open(f"/proc/{sh}/task/{sh}/children").read().split()
        return int(children[0])

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def start_top(n: Nettap) -> Tmux:
    t = Tmux(f"{sys.executable} -m exporter top --interval 0.5 --url {n.url}/metrics")
    ours = held_programs(n.p.pid)
    try:
        # nettap's own programs, rated (a second sample) and running under the traffic.
        wait_for(lambda: any(r[0] in ours and r[4] for r in rows(t.screen())), timeout=20,
                 what="nettap's programs with runs/s > 0 in the view")
    except BaseException:
        print(t.screen())
        t.close()
        raise
    return t


def test_live_view_shows_rates_sorts_and_quits_with_stats_released(loaded):
    n = loaded
    t = start_top(n)
    try:
        pid = t.top_pid()
        assert stats_fds(pid) == 1 and kernel_stats_on()         # held while the view runs
        # Every program nettap holds is a row, once the view has refreshed
        # after nettap's last load (its stats probe may load at a scrape).
        def all_shown():
            screen = t.screen()
            return (held_programs(n.p.pid) <= {r[0] for r in rows(screen)}) and screen
        screen = wait_for(all_shown, timeout=20, what="every program nettap holds as a row")
        ours = held_programs(n.p.pid)
        shown = {r[0]: r for r in rows(screen)}
        assert ours <= set(shown), "every program nettap holds is a row"
        names = bpftool_names(ours)
        comm = open(f"/proc/{n.p.pid}/comm").read().strip()
        for i in ours:                                           # named as bpftool names them
            assert shown[i][1] == names[i] and shown[i][3] == f"{n.p.pid}/{comm}"
        assert shown[max(ours, key=lambda i: shown[i][4] or 0)][4] > 0
        # nettap's own section, read from its endpoint.
        assert f"at {n.url}/metrics" in screen
        calls = re.search(r"^tcp_sendmsg\s+([\d,.]+)\s*$", screen, re.M)
        assert calls and float(calls.group(1).replace(",", "")) > 0, screen
        assert re.search(r"^capture_chunks\s+[\d.]+\s+[\d,.]+\s*$", screen, re.M), screen
        assert "%CPU ▼" in screen                               # the default: most CPU first

        t.keys("2")                                              # sort by name, A to Z
        names_shown = sorted_view(t, "NAME ▲", lambda r: r[1], False)
        assert len(set(names_shown)) > 1
        t.keys("2")                                              # again: Z to A
        sorted_view(t, "NAME ▼", lambda r: r[1], True)
        t.keys("5")                                              # runs/s, most first
        runs = sorted_view(t, "RUNS/S ▼", lambda r: r[4], True)
        assert runs[0] > 0

        t.keys("q")
        wait_for(lambda: "nettap-top-exit=0" in t.screen(), timeout=10, what="q quits")
        assert not os.path.exists(f"/proc/{pid}")
        stats_off_but_for_others()
    finally:
        t.close()


@pytest.mark.parametrize("how", ["C-c", signal.SIGTERM, signal.SIGHUP])
def test_stats_released_on_ctrl_c_and_signals(loaded, how):
    t = start_top(loaded)
    try:
        pid = t.top_pid()
        assert stats_fds(pid) == 1
        if how == "C-c":
            t.keys("C-c")
        else:
            os.kill(pid, how)
        wait_for(lambda: "nettap-top-exit=0" in t.screen(), timeout=10, what="a clean exit")
        assert not os.path.exists(f"/proc/{pid}")
        stats_off_but_for_others()
    finally:
        t.close()


def test_once_prints_one_table_with_rates(loaded):
    n = loaded
    # The installed command, as the README runs it.
    r = subprocess.run([str(ROOT / "scripts/run.sh"), "top", "--once", "--sort", "runs",
                        "--url", f"{n.url}/metrics"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ours = held_programs(n.p.pid)
    got = [x for x in rows(r.stdout) if x[0] in ours]
    assert {x[0] for x in got} == ours and max(x[4] for x in got) > 0
    runs = [x[4] for x in rows(r.stdout) if x[4] is not None]
    assert runs == sorted(runs, reverse=True)
    assert re.search(r"^tcp_sendmsg\s+([1-9][\d,]*\.\d)\s*$", r.stdout, re.M), r.stdout
    # No nettap at the URL: said in the output, not an error.
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    r = subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--interval", "0.2", "--url", closed],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"nettap: no nettap at {closed}" in r.stdout, r.stdout + r.stderr
    assert ours <= {x[0] for x in rows(r.stdout)}
