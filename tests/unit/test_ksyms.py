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
ffffffff820dbb40 T cookie_v4_check
ffffffff820dbc00 T cookie_init_timestamp
ffffffffc0a02000 t tcp_v6_rcv\t[ipv6]
ffffffffc0a01000 t tcp_v6_init_sock\t[ipv6]
ffffffffc0a03000 t tcp_v6_connect\t[ipv6]
"""


def _file(tmp_path, text):
    ksyms.settings.cache_clear()
    p = tmp_path / "kallsyms"
    p.write_text(text)
    return str(p)


def _words(path, timewait=True):
    return struct.unpack(f"<{tcp_h.STRUCTS['nettap_ksyms'][0] // 8}Q", ksyms.settings(path, timewait))


def _layout(words):
    """(handler, deschedule ranges, tw caller slots, request handler, request caller slots), empty slots left out."""
    d = 1 + tcp_h.KSYM_DESCHEDULE * 2
    c = d + tcp_h.KSYM_CALLERS * 3
    desc = [words[1 + i * 2:3 + i * 2] for i in range(tcp_h.KSYM_DESCHEDULE)]
    callers = [words[d + i * 3:d + 3 + i * 3] for i in range(tcp_h.KSYM_CALLERS)]
    req = [words[c + 1 + i * 3:c + 4 + i * 3] for i in range(tcp_h.KSYM_REQ_CALLERS)]
    return (words[0], [r for r in desc if any(r)], [r for r in callers if any(r)], words[c],
            [r for r in req if any(r)])


def test_the_addresses_and_causes_of_each_function(tmp_path):
    handler, desc, callers, req_handler, req = _layout(_words(_file(tmp_path, KALLSYMS)))
    assert (handler, desc) == (0xffffffff8205c7b0, [(0xffffffff8205c7d0, 0xffffffff8205c840)])
    assert callers == [
        (0xffffffff8208ccf0, 0xffffffff8208d160, tcp_h.TW_RESET),
        (0xffffffff82059410, 0xffffffff82059750, tcp_h.TW_REUSED),
        (0xffffffff8205b7e0, 0xffffffff8205c060, tcp_h.TW_REUSED),
        (0xffffffff8208ae50, 0xffffffff8208c250, 0),
        (0xffffffffc0a02000, 0xffffffffc0a03000, 0),          # a module's: the nearest address above
        (0xffffffff8205ce00, 0xffffffff8205cf60, tcp_h.TW_PURGED)]
    assert req_handler == 0xffffffff8205ed50
    assert req == [
        (0xffffffff820609b0, 0xffffffff82060c00, tcp_h.REQ_ESTABLISHED),
        (0xffffffff8208d6a0, 0xffffffff8208dc00, tcp_h.REQ_RESET),
        (0xffffffff8208ae50, 0xffffffff8208c250, tcp_h.REQ_CLOSED),
        (0xffffffffc0a02000, 0xffffffffc0a03000, tcp_h.REQ_CLOSED),
        (0xffffffff820dbb40, 0xffffffff820dbc00, tcp_h.REQ_COOKIE)]


def test_a_functions_clones_take_slots_of_their_own(tmp_path):
    """gcc's .constprop.N, .isra.N, .part.N and .cold clones of a function looked
    up are on the stack under their own names: each a range with the function's
    cause, after the function's own; a clone with no original is found too."""
    text = KALLSYMS.replace("ffffffff8208dc00 T tcp_child_process\n",
                            "ffffffff8208dc00 t tcp_check_req.part.0\nffffffff8208dd00 T tcp_child_process\n")
    text = text.replace("T inet_twsk_deschedule_put\n", "t inet_twsk_deschedule_put.constprop.0\n")
    text = text.replace("t inet_twsk_kill\n", "t inet_twsk_kill\nffffffff8205c900 t tcp_v4_rcv.cold\n")
    text = text.replace("T tcp_v4_early_demux\n", "T tcp_v4_early_demux\nffffffff8208c300 t tcp_v4_rcv.isra.3\n"
                        "ffffffff8208c380 t tcp_v4_rcvx\n")
    handler, desc, callers, _, req = _layout(_words(_file(tmp_path, text)))
    assert desc == [(0xffffffff8205c7d0, 0xffffffff8205c840)]
    assert [c for c in callers if c[2] == 0][:3] == [
        (0xffffffff8208ae50, 0xffffffff8208c250, 0), (0xffffffff8205c900, 0xffffffff8205ce00, 0),
        (0xffffffff8208c300, 0xffffffff8208c380, 0)]          # tcp_v4_rcvx is another function
    assert (0xffffffff8208dc00, 0xffffffff8208dd00, tcp_h.REQ_RESET) in req


def test_the_time_wait_timer_function_is_left_zero_while_its_programs_are_detached(tmp_path):
    path = _file(tmp_path, KALLSYMS)
    on, off = _layout(_words(path)), _layout(_words(path, timewait=False))
    assert (on[0], off[0]) == (0xffffffff8205c7b0, 0) and on[1:] == off[1:]


def test_a_caller_not_found_stays_zero(tmp_path):
    text = "".join(line + "\n" for line in KALLSYMS.splitlines() if "tcp_v6" not in line)
    _, _, callers, _, req = _layout(_words(_file(tmp_path, text)))
    assert len(callers) == 5 and all(c[0] != 0xffffffffc0a02000 for c in callers + req)


def test_hidden_addresses_and_a_missing_timer_function_are_refused(tmp_path):
    hidden = "".join("0000000000000000" + line[16:] + "\n" for line in KALLSYMS.splitlines())
    with pytest.raises(OSError, match="hides"):
        ksyms.settings(_file(tmp_path, hidden))
    text = "".join(line + "\n" for line in KALLSYMS.splitlines() if "tw_timer_handler" not in line)
    with pytest.raises(OSError, match="no tw_timer_handler"):
        ksyms.settings(_file(tmp_path, text))
