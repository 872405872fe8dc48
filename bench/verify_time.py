"""What the kernel's verifier spends on each of nettap's programs at load,
from the verifier's own statistics (log level 4: "verification time N usec",
"processed N insns"), the programs a start loads on this kernel:

  sudo .venv/bin/python bench/verify_time.py
  sudo .venv/bin/python bench/verify_time.py --against /tmp/old/bpf   # another build, same run
  sudo .venv/bin/python bench/verify_time.py --variant compat --dns

Each object is loaded --rounds times, alternating with --against's; each
program's median is printed. Start time as a whole: bench/storm.py --idle.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from exporter.kernel import arch, libbpf, loader  # noqa: E402
from exporter.kernel.mechanisms import ensure_tracefs, plan  # noqa: E402
from exporter.kernel.objects import configure, object_programs  # noqa: E402

TIME = re.compile(r"verification time (\d+) usec")
INSNS = re.compile(r"processed (\d+) insns")


def _object(bpf_dir: str, name: str) -> str:
    """name in bpf_dir: a checkout's bpf/ (one directory per architecture), or
    a directory of this machine's objects (an older checkout's bpf/)."""
    path = arch.object_path(name, bpf_dir=bpf_dir)
    return path if os.path.exists(path) else os.path.join(bpf_dir, name)


def verify(path: str, kernel_plan, want: dict) -> dict:
    """{program: (usec, insns)} of one load of the object at path."""
    lb = libbpf.lib()
    lb.bpf_program__set_log_level.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lb.bpf_program__set_log_buf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    obj = libbpf.call_ptr("bpf_object__open_file", path.encode(), None)
    try:
        configure(obj, kernel_plan.features, kernel_plan.variant, want, {})
        bufs = {}
        for name, prog in object_programs(obj):
            if name in want:
                bufs[name] = ctypes.create_string_buffer(1 << 16)
                lb.bpf_program__set_log_buf(prog, bufs[name], len(bufs[name]))
                lb.bpf_program__set_log_level(prog, 4)          # BPF_LOG_STATS: no per-insn log
        libbpf.call("bpf_object__load", obj)
    finally:
        lb.bpf_object__close(obj)
    out = {}
    for name, buf in bufs.items():
        log = buf.value.decode(errors="replace")
        t, n = TIME.search(log), INSNS.search(log)
        out[name] = (int(t.group(1)) if t else 0, int(n.group(1)) if n else 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=("fast", "compat"), help="default: the kernel's")
    ap.add_argument("--dns", action="store_true", help="the DNS programs too (loaded when capture.dns is on)")
    ap.add_argument("--against", help="a directory of other BPF objects, loaded alternately in the same run")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ensure_tracefs()
    kp = plan(None, a.variant)
    probes = loader.Probes(kernel_plan=kp, dns_now=a.dns)      # which programs a start loads here
    want, name = probes._wanted_programs(), loader.object_for(kp.features)
    probes.close()
    dirs = {"this build": arch.BPF_DIR} | ({"against": a.against} if a.against else {})
    runs = {label: [] for label in dirs}
    for _ in range(a.rounds):
        for label, d in dirs.items():
            runs[label].append(verify(_object(d, name), kp, want))
    med = {label: {p: (statistics.median(r[p][0] for r in rs), rs[0][p][1]) for p in rs[0]}
           for label, rs in runs.items()}
    print(f"nettap verification time at load ({name}, {kp.variant} variant, kernel {os.uname().release}; "
          f"median of {a.rounds} loads, microseconds)\n")
    labels = list(dirs)
    print(f"{'program':28s}" + "".join(f"{lab:>16s}{'insns':>8s}" for lab in labels))
    order = sorted(med[labels[0]], key=lambda p: -med[labels[0]][p][0])
    for p in order:
        print(f"{p:28s}" + "".join(f"{med[lab].get(p, (0, 0))[0]:16.0f}{med[lab].get(p, (0, 0))[1]:8d}"
                                   for lab in labels))
    print(f"{'total':28s}" + "".join(f"{sum(v[0] for v in med[lab].values()):16.0f}{'':8s}" for lab in labels))


if __name__ == "__main__":
    main()
