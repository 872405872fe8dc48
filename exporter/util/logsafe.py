"""Log lines that values cannot forge.

A config key, a path or a header logged as is could carry a newline and
write a second, made-up log line (``...: unknown key 'x\\n2026-01-01 ERROR
...'``). One filter on the handler escapes control characters in every
record's message, whatever the logger or formatter; a traceback keeps its
lines but each is indented, so none starts like a log line.
"""
from __future__ import annotations

import json
import logging
import re
import time

# C0 controls, DEL, C1 controls, and the Unicode line and paragraph
# separators (some log viewers break lines there).
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 0x2028: "\\u2028", 0x2029: "\\u2029"})

_BARE = re.compile(r'[^\x00-\x20"=\\\x7f-\xa0\u2028\u2029]+\Z')

# What json.dumps leaves raw and a log viewer may break a line at.
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in [*range(0x80, 0xA0), 0x2028, 0x2029]}


def escape(text: str) -> str:
    """text with every control character written as an escape."""
    return text.translate(_ESCAPES)


def _indent_traceback(text: str) -> str:
    return "\n".join("    " + escape(line) for line in text.split("\n"))


class EscapeFilter(logging.Filter):
    """Escapes control characters in the message of each record it passes
    (attach it to a handler: it then covers every logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "nettap_escaped", False):      # seen by another handler's filter
            return True
        record.nettap_escaped = True
        msg = record.getMessage()
        safe = escape(msg)
        if safe != msg or record.args:
            record.msg, record.args = safe, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _indent_traceback(record.exc_text)
        if record.stack_info:
            record.stack_info = _indent_traceback(record.stack_info)
        return True


def install(handler: logging.Handler) -> None:
    handler.addFilter(EscapeFilter())


def _quoted(value: str) -> str:
    """value as a logfmt/JSON string body: backslashes and quotes escaped,
    then every control character (escape())."""
    return escape(value.replace("\\", "\\\\").replace('"', '\\"'))


class _Structured(logging.Formatter):
    """Fields ts, level, logger, msg (and exc for a traceback), as the
    Prometheus exporters' go-kit/slog loggers write them."""

    def fields(self, record: logging.LogRecord) -> list:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = [("ts", f"{ts}.{int(record.msecs):03d}Z"), ("level", record.levelname.lower()),
               ("logger", record.name), ("msg", record.getMessage())]
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out.append(("exc", record.exc_text))
        if record.stack_info:
            out.append(("stack", record.stack_info))
        return out


class LogfmtFormatter(_Structured):
    """One key=value line a record; a value with a space, '=', a quote or a
    control character is quoted, with escapes."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={v}" if v and _BARE.match(v) else f'{k}="{_quoted(v)}"'
                        for k, v in self.fields(record))


class JSONFormatter(_Structured):
    """One JSON object a record."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(self.fields(record)), ensure_ascii=False).translate(_JSON_ESCAPES)


FORMATTERS = {"logfmt": LogfmtFormatter, "json": JSONFormatter}
