"""Two nettap instances on one node (the real CLI, twice): each reports the
kernel's BPF statistics state, and which of them holds it on."""
from procs import Nettap, stats_held_elsewhere, wait_for



def test_the_instance_not_holding_stats_reports_them_on(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = lambda on: {"output": {"type": "none"}, "diagnostics": {"bpfStats": {"enabled": on}}}
    a = Nettap(tmp_path / "a", cfg(True))
    b = None
    try:
        b = Nettap(tmp_path / "b", cfg(False))
        assert a.sample("nettap_bpf_stats_enabled") == 1
        assert a.sample("nettap_bpf_stats_source", source="fd") == 1
        assert b.sample("nettap_bpf_stats_enabled") == 1
        assert b.sample("nettap_bpf_stats_source", source="external") == 1
        assert b.sample("nettap_bpf_stats_source", source="fd") is None
        a.stop()
        # Now on only if some other process on this machine holds them on.
        wait_for(lambda: b.sample("nettap_bpf_stats_enabled") == (1 if stats_held_elsewhere() else 0),
                 timeout=60, what="b to follow the kernel after a stopped")
    finally:
        a.stop()
        if b:
            b.stop()
