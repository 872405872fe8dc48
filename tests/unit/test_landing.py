"""exporter.web.landing: the page at / from a plain document; every value escaped."""
from __future__ import annotations

import re

from exporter.web import landing

HOSTILE = '</code><script>alert("x")</script>\'\n<img src=x onerror=alert(1)>'


def doc(**over) -> dict:
    d = {
        "version": "0.1.0",
        "variant": "fast",
        "config": {"path": "/etc/nettap/" + HOSTILE + ".yaml", "last_ok": False,
                   "last_success": 1700000000.0, "last_failure": 1700000100.0,
                   "error": "captures[0].port: " + HOSTILE, "successes": 1, "failures": 2},
        "captures": [{"kind": "port", "value": 8080, "gone": False},
                     {"kind": "cgroup", "value": "/sys/fs/cgroup/" + HOSTILE, "gone": True}],
        "probes": [{"probe": "tcp_sendmsg", "mechanism": "tracepoint", "attached": True, "error": ""},
                   {"probe": "tcp_recvmsg", "mechanism": "none", "attached": False, "error": HOSTILE}],
        "rings": [{"ring": "capture_chunks", "capacity": 4 << 20, "pending": 1 << 20, "drops": 0},
                  {"ring": "logs", "capacity": 4096, "pending": 0, "drops": 7}],
        "bpf_stats": {"wanted": True, "source": "fd", "scope": "own"},
    }
    d.update(over)
    return d


def test_every_section_and_value():
    page = landing.render(doc())
    for sid in ("config", "captures", "probes", "rings", "bpf-stats", "links"):
        assert f'<section id="{sid}">' in page
    assert "<h1>nettap 0.1.0</h1>" in page
    assert "failure</span> at 2023-11-14 22:15:00 UTC" in page
    assert "loaded at 2023-11-14 22:13:20 UTC stays in force" in page
    assert "Loads: 1 succeeded, 2 refused" in page
    assert "<td>port</td><td><code>8080</code></td>" in page
    assert "tracepoint" in page and "not attached" in page
    assert '<td class="n">25.0 %</td>' in page and '<td class="n">0.0 %</td>' in page
    assert '<span class="bad">7</span>' in page
    assert "on, held by this nettap (a BPF_ENABLE_STATS fd)" in page
    assert "enabled true, scope own" in page
    for path in ("/metrics", "/stats", "/healthz", "/readyz"):
        assert f'<a href="{path}">{path}</a>' in page


def test_hostile_strings_are_escaped():
    page = landing.render(doc(version=HOSTILE))
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "onerror=alert(1)" in page             # as text, inside an escaped tag
    esc = ('&lt;/code&gt;&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&#x27;\n'
           '&lt;img src=x onerror=alert(1)&gt;')
    # The path, the error, a capture, a probe's error and the version: each escaped.
    assert page.count(esc) == 6                   # version twice (title, heading)
    assert not re.search(r"https?://", page)      # nothing fetched from elsewhere
    # Tags are only the page's own.
    assert set(re.findall(r"<(/?[a-z0-9]+)", page)) <= {
        "html", "/html", "head", "/head", "meta", "title", "/title", "style", "/style", "body", "/body",
        "h1", "/h1", "h2", "/h2", "p", "/p", "section", "/section", "table", "/table", "tr", "/tr",
        "th", "/th", "td", "/td", "span", "/span", "code", "/code", "ul", "/ul", "li", "/li", "a", "/a"}


def test_reload_success_no_config_no_captures_stats_off():
    page = landing.render(doc(config={"path": None, "last_ok": True, "last_success": 1700000000.0,
                                      "last_failure": 0.0, "error": "", "successes": 1, "failures": 0},
                              captures=[], bpf_stats={"wanted": False, "source": None, "scope": "own"}))
    assert "Config file: none (built-in default config)" in page
    assert 'Last reload: <span class="ok">success</span> at 2023-11-14 22:13:20 UTC' in page
    assert "Error:" not in page
    assert "None: nothing is captured" in page
    assert "Kernel BPF run-time statistics: off" in page


def test_undecodable_path_still_encodes():
    # argv holds undecodable bytes as lone surrogates (surrogateescape).
    page = landing.render(doc(config={**doc()["config"], "path": "/etc/n\udcff.yaml"}))
    assert "/etc/n\\udcff.yaml" in page.encode("utf-8").decode("utf-8")


def test_version_only():
    page = landing.render({"version": "0.1.0"})
    assert "<h1>nettap 0.1.0</h1>" in page and '<section id="links">' in page
    assert '<section id="config">' not in page
