"""Log lines that values cannot forge.

A config key, a path or a header logged as is could carry a newline and
write a second, made-up log line (``...: unknown key 'x\\n2026-01-01 ERROR
...'``). One filter on the handler escapes control characters in every
record's message, whatever the logger or formatter; a traceback keeps its
lines but each is indented, so none starts like a log line.
"""
from __future__ import annotations

import logging

# C0 controls, DEL, C1 controls, and the Unicode line and paragraph
# separators (some log viewers break lines there).
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 0x2028: "\\u2028", 0x2029: "\\u2029"})


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
