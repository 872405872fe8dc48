"""The start refuses, by name, a machine nettap has no BPF objects for
(exporter/kernel/arch.py), before it asks the kernel anything; it takes
x86_64 and aarch64, the machines bpf/<arch>/*.bpf.o are built for, and
names each one's objects."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from exporter import config
from exporter.commands import start
from exporter.kernel import arch, mechanisms
from exporter.kernel.features import Unsupported

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("machine", ["riscv64", "ppc64le", "s390x", "i686", "armv7l"])
def test_start_refuses_a_machine_without_objects_by_name(monkeypatch, capsys, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(mechanisms, "kprobe_support", lambda: pytest.fail("asked the kernel"))
    with pytest.raises(Unsupported, match=f"machine {machine}: nettap has BPF objects only for x86_64, aarch64"):
        mechanisms.plan()
    # What the daemon's start prints (commands/start.py, _attach): one line, exit status 1.
    assert start._attach(config.DEFAULT, start.Background(mechanisms.plan, None, None)) == 1
    assert capsys.readouterr().err == (f"nettap: cannot run here: machine {machine}: nettap has BPF objects only "
                                       "for x86_64, aarch64 (bpf/*/*.bpf.o are built per architecture)\n")


@pytest.mark.parametrize("machine,target", [("x86_64", "x86"), ("aarch64", "arm64")])
def test_start_takes_x86_64_and_aarch64(monkeypatch, machine, target):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert arch.target() == target
    assert arch.target(machine) == target
    for name in ("tcp.bpf.o", "tcp_open_loop.bpf.o", "node.bpf.o"):
        assert arch.object_path(name) == os.path.join(arch.BPF_DIR, target, name)
        assert arch.object_path(name, bpf_dir="/x") == f"/x/{target}/{name}"
        assert os.path.isfile(arch.object_path(name, bpf_dir=str(ROOT / "bpf")))      # committed, whatever the host


def test_an_objects_path_is_refused_for_a_machine_without_objects():
    with pytest.raises(Unsupported, match="machine riscv64: nettap has BPF objects only for x86_64, aarch64"):
        arch.object_path("tcp.bpf.o", "riscv64")



@pytest.mark.parametrize("machine,header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                            ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_syscall_numbers_per_machine_are_the_kernels(machine, header):
    """The numbers nettap calls bpf(2) and perf_event_open(2) by, against the uapi headers
    (linux-libc-dev: x86-64's table, and asm-generic's, which arm64 uses)."""
    import re
    text = Path(header).read_text()
    for name in ("bpf", "perf_event_open"):
        assert arch.syscall_nr(name, machine) == int(re.search(rf"#define __NR_{name} (\d+)", text).group(1))
    with pytest.raises(Unsupported, match="machine riscv64"):
        arch.syscall_nr("bpf", "riscv64")
