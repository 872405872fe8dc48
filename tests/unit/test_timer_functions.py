"""features.timer_functions: the kernel functions bpf/timer.bpf.h tells a
socket's timers by, read from a kallsyms file (a fake one here)."""
import struct

from exporter.kernel import features


def test_addresses_in_the_order_of_struct_nettap_kernel(tmp_path):
    f = tmp_path / "kallsyms"
    f.write_text("ffffffff81244513 t tcp_keepalive_timer.cold\n"
                 "ffffffff8208cef0 t tcp_keepalive_timer\n"
                 "ffffffff8208e3a0 t tcp_write_timer\n"
                 "ffffffff8208e3b0 t tcp_write_timer_handler\n")
    assert features.timer_functions(str(f)) == (0xffffffff8208e3a0, 0xffffffff8208cef0)


def test_hidden_or_missing_is_zero(tmp_path):
    f = tmp_path / "kallsyms"
    f.write_text("0000000000000000 t tcp_keepalive_timer\n")      # kernel.kptr_restrict
    assert features.timer_functions(str(f)) == (0, 0)
    assert features.timer_functions(str(tmp_path / "absent")) == (0, 0)


def test_kernel_settings_leave_the_timers_out_without_the_feature():
    feats = [features.Feature("bpf_get_current_ancestor_cgroup_id", "5.14", True, ""),
             features.Feature("tcp timer functions", "-", False, "")]
    assert features.kernel_settings(feats) == struct.pack("<I4xQQ", 1, 0, 0)
