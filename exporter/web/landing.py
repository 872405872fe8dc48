"""The landing page (GET /): what this nettap is doing, on one static page.

:func:`render` turns a plain dict (``Nettap.landing()`` builds it) into
HTML: no script, nothing fetched from elsewhere, inline CSS only. Every
value goes through :func:`_e`: config paths and reload errors are text
an operator (or whoever can write the config file) chose.
"""
from __future__ import annotations

import html
import time

CSS = """body{font:14px/1.4 sans-serif;margin:1.5em;color:#222;max-width:70em}
h1{font-size:1.5em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.2em 0 .3em;border-bottom:1px solid #ccc}
table{border-collapse:collapse}td,th{padding:.15em .8em .15em 0;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}.ok{color:#17692e}.bad{color:#b00020;font-weight:bold}
.msg{white-space:pre-wrap;font-family:monospace}"""

LINKS = (("/metrics", "Prometheus metrics"), ("/stats", "probe counters as JSON"),
         ("/healthz", "process alive"), ("/readyz", "probes attached and drain running"))


def _e(v) -> str:
    # A path from argv holds undecodable bytes as lone surrogates, which
    # UTF-8 cannot encode: write them as escapes (\udcff: byte 0xff).
    return html.escape(str(v).encode("utf-8", "backslashreplace").decode("utf-8"), quote=True)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "never"


def _ok(good: bool, text: str) -> str:
    return f'<span class="{"ok" if good else "bad"}">{_e(text)}</span>'


def _table(head, rows) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table><tr>{th}</tr>" + "".join(f"<tr>{''.join(rows_)}</tr>" for rows_ in rows) + "</table>"


def _config(c: dict) -> str:
    path = c["path"]
    out = [f"<p>Config file: <code>{_e(path)}</code></p>" if path
           else "<p>Config file: none (built-in default config)</p>"]
    if c["last_ok"]:
        out.append(f"<p>Last reload: {_ok(True, 'success')} at {_e(_when(c['last_success']))}</p>")
    else:
        out.append(f"<p>Last reload: {_ok(False, 'failure')} at {_e(_when(c['last_failure']))}; "
                   f"the config loaded at {_e(_when(c['last_success']))} stays in force</p>"
                   f'<p>Error: <span class="msg">{_e(c["error"])}</span></p>')
    out.append(f"<p>Loads: {_e(c['successes'])} succeeded, {_e(c['failures'])} refused</p>")
    return "".join(out)


def _captures(caps: list) -> str:
    if not caps:
        return "<p>None: nothing is captured (add <code>captures:</code> to the config file).</p>"
    return _table(("kind", "target", "state"), (
        (f"<td>{_e(c['kind'])}</td>", f"<td><code>{_e(c['value'])}</code></td>",
         f"<td>{_ok(False, 'gone') if c['gone'] else _ok(True, 'in force')}</td>") for c in caps))


def _probes(probes: list) -> str:
    return _table(("probe", "mechanism", "state"), (
        (f"<td>{_e(p['probe'])}</td>", f"<td>{_e(p['mechanism'])}</td>",
         f"<td>{_ok(True, 'attached')}</td>" if p["attached"]
         else f'<td>{_ok(False, "not attached")} <span class="msg">{_e(p["error"])}</span></td>')
        for p in probes))


def _rings(rings: list) -> str:
    def fill(r):
        return f"{100 * r['pending'] / r['capacity']:.1f} %" if r["capacity"] else "-"
    return _table(("ring", "fill", "pending bytes", "capacity bytes", "drops"), (
        (f"<td>{_e(r['ring'])}</td>", f'<td class="n">{_e(fill(r))}</td>',
         f'<td class="n">{_e(r["pending"])}</td>', f'<td class="n">{_e(r["capacity"])}</td>',
         f'<td class="n">{_ok(not r["drops"], r["drops"])}</td>') for r in rings))


SOURCES = {"fd": "held by this nettap (a BPF_ENABLE_STATS fd)",
           "sysctl": "switched on by this nettap (kernel.bpf_stats_enabled=1)",
           "external": "held by another process (its own BPF_ENABLE_STATS fd, or the sysctl)"}


def _bpf_stats(s: dict) -> str:
    src = s["source"]
    state = f"on, {SOURCES.get(src, src)}" if src else "off"
    return (f"<p>Kernel BPF run-time statistics: {_e(state)}</p>"
            f"<p>Config (<code>diagnostics.bpfStats</code>): enabled {_e(str(s['wanted']).lower())}, "
            f"scope {_e(s['scope'])}</p>")


# (id, heading, key in the doc, renderer)
SECTIONS = (("config", "Config", "config", _config), ("captures", "Captures", "captures", _captures),
            ("probes", "Probes", "probes", _probes), ("rings", "Rings", "rings", _rings),
            ("bpf-stats", "BPF statistics", "bpf_stats", _bpf_stats))


def render(doc: dict) -> str:
    """The page for doc: version, and each section whose key doc has."""
    parts = [f'<!doctype html>\n<html><head><meta charset="utf-8"><title>nettap {_e(doc["version"])}</title>'
             f"<style>{CSS}</style></head>\n<body><h1>nettap {_e(doc['version'])}</h1>\n"
             "<p>A lean eBPF TCP collector that tells exactly what running it costs.</p>\n"]
    if doc.get("variant"):
        parts.append(f"<p>BPF programs: {_e(doc['variant'])} variant</p>\n")
    for sid, head, key, fn in SECTIONS:
        if key in doc:
            parts.append(f'<section id="{sid}"><h2>{_e(head)}</h2>{fn(doc[key])}</section>\n')
    parts.append('<section id="links"><h2>Endpoints</h2><ul>'
                 + "".join(f'<li><a href="{_e(p)}">{_e(p)}</a>: {_e(what)}</li>'
                           for p, what in ((doc.get("telemetry_path", "/metrics"), LINKS[0][1]), *LINKS[1:]))
                 + "</ul></section>\n</body></html>\n")
    return "".join(parts)
