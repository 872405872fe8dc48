"""exporter/kernel/followed.py without a kernel: the counts' offsets from
the object's symbol table, and a failure to forget, which is logged while
the rest is forgotten (the maps themselves: tests/kernel/test_timewait.py,
test_requests.py)."""
import logging
from pathlib import Path

from exporter.kernel import followed, tcp_h

OBJECT = Path(__file__).resolve().parents[2] / "bpf" / "x86" / "tcp.bpf.o"


def test_each_count_is_found_in_the_object():
    wanted = [v for _t, _o, counts in followed.FOLLOWED.values() for v in counts]
    got = followed.var_offsets(str(OBJECT), wanted)
    assert set(got) == set(wanted) and all(size == 4 and off % 4 == 0 for off, size in got.values()), got
    assert got[(".bss.requests", "requests_tracked")] != got[(".bss.requests", "request_slots_armed")]


def test_a_failure_is_logged_and_the_rest_forgotten(monkeypatch, caplog, tmp_path):
    """The object gone (no symbol table to read): each probe's maps emptied
    and counted all the same, the counts not zeroed, said in the log; a
    probe that follows nothing is left alone."""
    monkeypatch.setattr(followed, "grace_period", lambda: None)
    emptied = []
    monkeypatch.setattr(followed, "_empty", lambda fd, info: emptied.append(fd) or 3)
    names = [n for t, o, c in followed.FOLLOWED.values() for n in (t, *o, *(s for s, _ in c))]
    fds = {n: i for i, n in enumerate(names)}
    with caplog.at_level(logging.ERROR, logger="exporter.kernel.followed"):
        got = followed.forget(["tcp_timewait", "tcp_request", "tcp_timer"], fds, dict.fromkeys(fds, (1, 8, 8, 1)),
                              str(tmp_path / "gone.bpf.o"))
    assert got == {tcp_h.OBS_TIMEWAIT + tcp_h.TW_FORGOTTEN: 3, tcp_h.OBS_REQUESTS + tcp_h.REQ_FORGOTTEN: 3}
    assert sorted(emptied) == sorted(fds[n] for n in ("timewait_socks", "request_socks", "request_listeners",
                                                      "request_slot"))
    assert caplog.text.count("not all forgotten") == 2, caplog.text
