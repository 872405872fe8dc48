"""exporter.util.logsafe: a value in a log message cannot forge a log line."""
from __future__ import annotations

import io
import json
import re
import logging

import pytest

from exporter import config
from exporter.util import logsafe

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"     # the CLI's


@pytest.fixture
def logged():
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter(FORMAT))
    logsafe.install(h)
    lg = logging.getLogger("test.logsafe")
    lg.addHandler(h)
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    yield lg, out
    lg.removeHandler(h)


FORGED = "x\n2026-01-01 00:00:00,000 ERROR nettap: forged"


def test_newline_in_an_argument_stays_on_one_line(logged):
    lg, out = logged
    lg.error("config %s: cannot read", FORGED)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("ERROR test.logsafe: config x\\n2026-01-01 00:00:00,000 ERROR nettap: forged: cannot read")


def test_newline_in_the_message_itself(logged):
    lg, out = logged
    lg.warning("path " + FORGED)
    assert len(out.getvalue().splitlines()) == 1


@pytest.mark.parametrize("ch, esc", [("\r", "\\r"), ("\t", "\\t"), ("\x1b", "\\x1b"), ("\x00", "\\x00"),
                                     ("\x7f", "\\x7f"), ("\x85", "\\x85"), ("\u2028", "\\u2028")])
def test_control_characters_escaped(logged, ch, esc):
    lg, out = logged
    lg.info("key %s", f"a{ch}b")
    assert out.getvalue().rstrip("\n").endswith(f"key a{esc}b")


def test_plain_text_untouched(logged):
    lg, out = logged
    lg.info("captures: %s; %d%%", "port=80 — ünïcode", 5)
    assert out.getvalue().endswith("captures: port=80 — ünïcode; 5%\n")


def test_traceback_lines_cannot_start_a_log_line(logged):
    lg, out = logged
    try:
        raise ValueError(FORGED)
    except ValueError:
        lg.exception("applying %s failed", "a\nb")
    first, *rest = out.getvalue().rstrip("\n").split("\n")
    assert first.endswith("applying a\\nb failed")
    assert rest and all(line.startswith("    ") for line in rest)
    assert any("ValueError: x" in line for line in rest)


def test_two_handlers_escape_once(logged):
    lg, out = logged
    out2 = io.StringIO()
    h2 = logging.StreamHandler(out2)
    logsafe.install(h2)
    lg.addHandler(h2)
    try:
        try:
            raise KeyError("k")
        except KeyError:
            lg.exception("a\\b %s", "\n")
    finally:
        lg.removeHandler(h2)
    assert out2.getvalue().startswith("a\\b \\n\n    Traceback")
    assert "\n        " not in out.getvalue().split("Traceback")[0]


def test_a_refused_config_key_logged_as_one_line(logged):
    lg, out = logged
    try:
        config.loads('output: {"a\\nb": 1}')
    except config.ConfigError as e:
        lg.error("config reload refused, previous config stays in force: %s", e)
    assert len(out.getvalue().splitlines()) == 1


def _structured(fmt: str):
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logsafe.FORMATTERS[fmt]())
    logsafe.install(h)
    lg = logging.getLogger(f"test.logsafe.{fmt}")
    lg.addHandler(h)
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    return lg, out


def _logfmt_pairs(line: str) -> dict:
    """A strict logfmt reader: bare values, or quoted with backslash escapes."""
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ "=]+)(?: |$)', line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, line
    unescape = lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m[1], m[1])    # noqa: E731
    return {k: re.sub(r'\\(.)', unescape, v[1:-1]) if v.startswith('"') else v for k, v in pairs}


def test_logfmt_lines_quote_and_escape():
    lg, out = _structured("logfmt")
    lg.warning('config %s: key "a=b" refused', FORGED)
    lg.info("ready")
    first, second = out.getvalue().splitlines()
    f = _logfmt_pairs(first)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", f["ts"])
    assert (f["level"], f["logger"]) == ("warning", "test.logsafe.logfmt")
    assert f["msg"] == 'config x\\n2026-01-01 00:00:00,000 ERROR nettap: forged: key "a=b" refused'
    assert second.endswith(" level=info logger=test.logsafe.logfmt msg=ready")


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_structured_traceback_stays_on_one_line(fmt):
    lg, out = _structured(fmt)
    try:
        raise ValueError(FORGED)
    except ValueError:
        lg.exception("applying %s failed", "a\u2028b")
    line, = out.getvalue().splitlines()
    assert "\u2028" not in line and "\x85" not in line
    fields = json.loads(line) if fmt == "json" else _logfmt_pairs(line)
    assert fields["msg"] == "applying a\\u2028b failed"
    assert "    ValueError: x\n    2026-01-01" in fields["exc"] and "Traceback" in fields["exc"]


def test_json_lines_parse():
    lg, out = _structured("json")
    lg.error("path %s \x1b[31m \x85 \"q\" \\", FORGED)
    line, = out.getvalue().splitlines()
    doc = json.loads(line)
    assert list(doc) == ["ts", "level", "logger", "msg"]
    assert doc["level"] == "error"
    assert doc["msg"] == 'path x\\n2026-01-01 00:00:00,000 ERROR nettap: forged \\x1b[31m \\x85 "q" \\'
