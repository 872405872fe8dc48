"""Kernel tests of the loader's fallback programs: what this kernel can and
cannot show about the mechanisms it does not attach."""
import errno

import pytest

from exporter import libbpf, loader

pytestmark = pytest.mark.kernel


def _load_only(suffixes):
    """Load the object with autoload on only for programs ending in suffixes."""
    lb = libbpf.lib()
    obj = libbpf.call_ptr("bpf_object__open_file", f"{loader.BPF_DIR}/{loader.OBJECT}".encode(), None)
    try:
        p = lb.bpf_object__next_program(obj, None)
        names = []
        while p:
            name = libbpf.name_of("bpf_program__name", p)
            on = name.endswith(suffixes)
            lb.bpf_program__set_autoload(p, on)
            names += [name] if on else []
            p = lb.bpf_object__next_program(obj, p)
        libbpf.call("bpf_object__load", obj)
        return names
    finally:
        lb.bpf_object__close(obj)


def test_kprobe_programs_pass_this_kernels_verifier():
    # Loading needs no kprobe support (only attaching does): the programs are verified.
    assert sorted(_load_only(("_kprobe", "_kretprobe"))) == [
        "tcp_recvmsg_kprobe", "tcp_recvmsg_kretprobe", "tcp_sendmsg_kprobe", "tcp_sendmsg_kretprobe"]


def test_fentry_programs_are_refused_here():
    with pytest.raises(OSError) as e:
        _load_only(("_fentry", "_fexit"))
    assert e.value.errno == errno.EPERM


def test_forcing_a_refused_mechanism_reports_the_probe_unattached():
    with loader.Probes(mechanism="kprobe") as p:
        for st in p.states.values():
            assert (st.mechanism, st.attached) == ("none", False)
            assert "no kprobes" in st.reasons["kprobe"] and st.reasons["fentry"] == "not requested"
            assert st.error.startswith("no mechanism accepted")
        assert len(p.links) == 1                  # the lifecycle program still runs
