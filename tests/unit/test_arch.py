"""The start refuses, by name, a machine nettap has no BPF objects for
(exporter/kernel/arch.py), before it asks the kernel anything; it takes
x86_64, the machine bpf/*.bpf.o are built for."""
from __future__ import annotations

import platform

import pytest

from exporter import config
from exporter.commands import start
from exporter.kernel import arch, mechanisms
from exporter.kernel.features import Unsupported


@pytest.mark.parametrize("machine", ["aarch64", "riscv64", "ppc64le", "s390x", "i686"])
def test_start_refuses_a_machine_without_objects_by_name(monkeypatch, capsys, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(mechanisms, "kprobe_support", lambda: pytest.fail("asked the kernel"))
    with pytest.raises(Unsupported, match=f"machine {machine}: nettap has BPF objects only for x86_64"):
        mechanisms.plan()
    # What the daemon's start prints (commands/start.py, _attach): one line, exit status 1.
    assert start._attach(config.DEFAULT, start.Background(mechanisms.plan, None, None)) == 1
    assert capsys.readouterr().err == (f"nettap: cannot run here: machine {machine}: nettap has BPF objects only "
                                       "for x86_64 (bpf/*.bpf.o are built per architecture)\n")


def test_start_takes_x86_64(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert arch.target() == "x86"
    assert arch.target("x86_64") == "x86"

