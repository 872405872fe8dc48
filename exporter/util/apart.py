"""A function of nettap's own run in a short-lived child process.

A live reload parses its YAML in one: parsing holds the interpreter lock
(libyaml's C code included), so in a thread of nettap it would slow every
scrape for as long as it runs; in a child, nettap's threads never wait for
it, its memory is never nettap's, and a stop kills it at once.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

_children: set = set()
_cancelled = False


class Failed(Exception):
    """The child could not be started, took too long, or gave no answer;
    args: what happened, and the last line it wrote to stderr, if any."""


class Cancelled(Exception):
    """cancel() was called (nettap is stopping)."""


def run(module: str, function: str, arg: str, stdin: bytes, timeout: float):
    """module.function() run in a child (argv[1] = arg, stdin given); its
    answer, which it writes pickled to stdout. The child is nettap's own
    code, given only data: its answer is plain data."""
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import sys; sys.path.insert(0, {pkg!r}); from {module} import {function}; {function}()"
    try:
        p = subprocess.Popen([sys.executable, "-I", "-c", code, arg], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        raise Failed(f"cannot start the YAML parser: {e.strerror}") from None
    _children.add(p)
    try:
        if _cancelled:
            p.kill()
        try:
            out, err = p.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise Failed(f"parsing took longer than {timeout:g} s") from None
    finally:
        _children.discard(p)
    if _cancelled:
        raise Cancelled()
    if p.returncode != 0 or not out:
        last = (err.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
        raise Failed(f"the YAML parser failed (exit status {p.returncode})", last)
    return pickle.loads(out)


def cancel() -> None:
    """Kill every child and refuse new ones (at stop)."""
    global _cancelled
    _cancelled = True
    for p in list(_children):
        try:
            p.kill()
        except OSError:
            pass
