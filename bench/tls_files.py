#!/usr/bin/env python3
"""What libssl files mapped by any user cost nettap (capture.tls): N copies
of the system's libssl, mapped by real processes (ctypes.CDLL), then the
real CLI started on them: the files attached, nettap's fds, and the time
from SIGTERM to its exit (before Linux 6.6 the kernel detaches uprobes one at
a time; NETTAP_TLS_UPROBE=uprobe forces that path on a later kernel).

  .venv/bin/python bench/tls_files.py 100     # as root
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from procs import Nettap, free_port  # noqa: E402

MAPPER = "import ctypes, sys\nfor p in sys.argv[1:]: ctypes.CDLL(p)\nprint('ok', flush=True)\nsys.stdin.read()"


def main(n: int) -> None:
    from exporter.kernel import tls
    tmp = Path(tempfile.mkdtemp(prefix="nettap-bench-tls-"))
    src = os.path.realpath(tls.system_files()[0])
    paths = []
    for i in range(n):
        (tmp / f"c{i}").mkdir()
        shutil.copy(src, tmp / f"c{i}" / "libssl.so.3")
        paths.append(str(tmp / f"c{i}" / "libssl.so.3"))
    mappers = []
    try:
        for k in range(0, n, 50):
            p = subprocess.Popen([sys.executable, "-c", MAPPER, *paths[k:k + 50]], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            mappers.append(p)
            assert p.stdout.readline().strip() == "ok"
        t = time.monotonic()
        nt = Nettap(tmp, {"captures": [{"port": free_port()}], "capture": {"tls": True}, "output": {"type": "none"}})
        print(f"{n} copies mapped: ready after {time.monotonic() - t:.2f} s")
        time.sleep(2)
        print(f"files attached {nt.sample('nettap_tls_files')}, refused (limit) "
              f"{nt.sample('nettap_tls_files_refused_total', reason='limit')}, "
              f"nettap's fds {len(os.listdir(f'/proc/{nt.p.pid}/fd'))}")
        t = time.monotonic()
        nt.p.send_signal(signal.SIGTERM)
        rc = nt.p.wait(900)
        print(f"SIGTERM to exit: {time.monotonic() - t:.1f} s (status {rc})")
        nt.log.close()
    finally:
        for p in mappers:
            p.kill()
            p.wait()
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
