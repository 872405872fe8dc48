"""exporter/kernel/ksyms.py: struct nettap_ksyms from a /proc/kallsyms of
the test's own."""
import struct

import pytest

from exporter.kernel import ksyms, tcp_h

# Core kernel text in address order, then a module's symbols (not in order).
KALLSYMS = """\
ffffffff81000000 T _stext
ffffffff82059410 t __inet_check_established
ffffffff82059750 t inet_ehash_insert
ffffffff8205b7e0 t __inet_hash_connect
ffffffff8205c060 T inet_hash_connect
ffffffff8205c7b0 t tw_timer_handler
ffffffff8205c7d0 T inet_twsk_deschedule_put
ffffffff8205c840 t inet_twsk_kill
ffffffff8205ce00 T inet_twsk_purge
ffffffff8205cf60 T inet_twsk_alloc
ffffffff8205ed50 t reqsk_timer_handler
ffffffff8205f4b0 T inet_csk_reqsk_queue_hash_add
ffffffff820609b0 T inet_csk_complete_hashdance
ffffffff82060c00 T inet_csk_listen_start
ffffffff8208ae50 T tcp_v4_rcv
ffffffff8208c250 T tcp_v4_early_demux
ffffffff8208ccf0 T tcp_timewait_state_process
ffffffff8208d160 T tcp_time_wait
ffffffff8208d6a0 T tcp_check_req
ffffffff8208dc00 T tcp_child_process
ffffffffc0a02000 t tcp_v6_rcv\t[ipv6]
ffffffffc0a01000 t tcp_v6_init_sock\t[ipv6]
ffffffffc0a03000 t tcp_v6_connect\t[ipv6]
"""


def _file(tmp_path, text):
    ksyms.settings.cache_clear()
    p = tmp_path / "kallsyms"
    p.write_text(text)
    return str(p)


def test_the_addresses_and_causes_of_each_function(tmp_path):
    words = struct.unpack(f"<{tcp_h.STRUCTS['nettap_ksyms'][0] // 8}Q", ksyms.settings(_file(tmp_path, KALLSYMS)))
    assert words[:3] == (0xffffffff8205c7b0, 0xffffffff8205c7d0, 0xffffffff8205c840)
    callers = [words[3 + i * 3:6 + i * 3] for i in range(tcp_h.KSYM_CALLERS)]
    assert callers == [
        (0xffffffff8208ccf0, 0xffffffff8208d160, tcp_h.TW_RESET),
        (0xffffffff82059410, 0xffffffff82059750, tcp_h.TW_REUSED),
        (0xffffffff8205b7e0, 0xffffffff8205c060, tcp_h.TW_REUSED),
        (0xffffffff8208ae50, 0xffffffff8208c250, 0),
        (0xffffffffc0a02000, 0xffffffffc0a03000, 0),          # a module's: the nearest address above
        (0xffffffff8205ce00, 0xffffffff8205cf60, tcp_h.TW_PURGED)]
    rest = words[3 + 3 * tcp_h.KSYM_CALLERS:]
    assert rest[0] == 0xffffffff8205ed50
    assert [rest[1 + i * 3:4 + i * 3] for i in range(tcp_h.KSYM_REQ_CALLERS)] == [
        (0xffffffff820609b0, 0xffffffff82060c00, tcp_h.REQ_ESTABLISHED),
        (0xffffffff8208d6a0, 0xffffffff8208dc00, tcp_h.REQ_RESET),
        (0xffffffff8208ae50, 0xffffffff8208c250, tcp_h.REQ_CLOSED),
        (0xffffffffc0a02000, 0xffffffffc0a03000, tcp_h.REQ_CLOSED)]


def test_a_caller_not_found_stays_zero(tmp_path):
    text = "".join(line + "\n" for line in KALLSYMS.splitlines() if "tcp_v6" not in line)
    words = struct.unpack(f"<{tcp_h.STRUCTS['nettap_ksyms'][0] // 8}Q", ksyms.settings(_file(tmp_path, text)))
    assert words[3 + 4 * 3:3 + 5 * 3] == (0, 0, 0)


def test_hidden_addresses_and_a_missing_timer_function_are_refused(tmp_path):
    hidden = "".join("0000000000000000" + line[16:] + "\n" for line in KALLSYMS.splitlines())
    with pytest.raises(OSError, match="hides"):
        ksyms.settings(_file(tmp_path, hidden))
    text = "".join(line + "\n" for line in KALLSYMS.splitlines() if "tw_timer_handler" not in line)
    with pytest.raises(OSError, match="no tw_timer_handler"):
        ksyms.settings(_file(tmp_path, text))
