"""``/proc/PID/mountinfo``, parsed in one place (proc(5), fs/proc_namespace.c).

A line: mount id, parent id, major:minor, root, mount point, mount options,
optional fields, a ``-`` separator, then filesystem type, source and super
options. Paths octal-escape space, tab, newline and backslash (``\\040``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List

_ESCAPED = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    root: str            # the path within the filesystem that is the mount's root
    mountpoint: str
    fstype: str
    source: str
    super_options: str


def unescape(field: str) -> str:
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> List[Mount]:
    """Every well-formed line's mount; a malformed line is skipped."""
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        out.append(Mount(unescape(fields[3]), unescape(fields[4]), tail[0],
                         tail[1] if len(tail) > 1 else "", tail[2] if len(tail) > 2 else ""))
    return out


def read(path: str = "/proc/self/mountinfo") -> List[Mount]:
    """The mounts path lists; raises OSError."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse(f.read())
