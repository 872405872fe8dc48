"""The declarative layer under nettap's three YAML parsers: the config file
(exporter/config.py), its ``ingest:`` section (exporter/ingest/settings.py)
and the web config (exporter/web/webconfig.py).

Each key is declared once, as a :class:`Key` of a :class:`Section`: its
name, its check (type and bounds), its default and one line of doc. A parser
takes a mapping through :meth:`Section.mapping` (unknown keys refused, named
with the ones expected) and each value through :meth:`Section.get` (checked,
defaulted); what relates keys to each other stays in the parser's own code.
docs/configuration.md's table of keys is rendered from the same sections
(scripts/gen_config_doc.py). Hand code, not jsonschema: the parsers' messages
(``output.backups: must be an integer from 0 to 1000, got -1``) are part of
the interface, and the checks are five small classes; a JSON Schema would
need its own messages mapped back to these.

Every error is a :class:`ConfigError` naming the key and the reason, the
refused value quoted and bounded (:func:`quote`).
"""
from __future__ import annotations

import reprlib
from collections import namedtuple

MAX_QUOTED = 80            # characters of a refused value quoted in a message


class ConfigError(ValueError):
    """A config that nettap refuses; str() names the key and the reason."""


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 2, MAX_QUOTED, MAX_QUOTED
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4


def quote(v) -> str:
    """repr(v), bounded: a refused value is quoted, not copied, into messages
    (whatever its size or depth; repr escapes newlines)."""
    r = _repr.repr(v)
    return r if len(r) <= MAX_QUOTED else r[:MAX_QUOTED - 3] + "..."


def key_name(k) -> str:
    """A key as written, when it is a plain name; quoted otherwise."""
    if isinstance(k, str) and k.isprintable() and 0 < len(k) <= MAX_QUOTED and k.strip() == k:
        return k
    return quote(k)


# -- checks: called with (value, key); return the value to use or raise ------

class Int:
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.text = f"integer, {_number(lo)} .. {_number(hi)}"

    def __call__(self, v, key: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise ConfigError(f"{key}: must be an integer from {self.lo} to {self.hi}, got {quote(v)}")
        return v


class Bool:
    text = "true, false"

    def __call__(self, v, key: str) -> bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{key}: must be true or false, got {quote(v)}")
        return v


class Choice:
    def __init__(self, *choices: str):
        self.choices = choices
        self.text = ", ".join(choices)

    def __call__(self, v, key: str) -> str:
        if v not in self.choices:
            raise ConfigError(f"{key}: must be one of {', '.join(self.choices)}, got {quote(v)}")
        return v


class Str:
    text = "string"

    def __call__(self, v, key: str) -> str:
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{key}: must be a non-empty string, got {quote(v)}")
        return v


class Check:
    """A check of the parser's own (fn(value, key)), with its doc text."""

    def __init__(self, fn, text: str):
        self.fn, self.text = fn, text

    def __call__(self, v, key: str):
        return self.fn(v, key)


def as_written(text: str) -> Check:
    """Taken as written here: the parser checks it in context."""
    return Check(lambda v, key: v, text)


ANY = as_written("")


class Key(namedtuple("Key", "name check default doc shown", defaults=(None, "", ""))):
    """name; check(value, key) -> value; default; doc: one line; shown: the
    default as the docs write it, when not the value itself (computed ones)."""

    __slots__ = ()


class Section:
    """The keys of one mapping, at path (e.g. "ingest.stream"; "" at the
    top). where: how a refusal of the mapping itself names it, when not by
    path; unsupported: {key: why} refused by name; Key entries whose check
    is a Section are sub-sections."""

    def __init__(self, path: str, *keys: Key, where: str = "", unsupported: dict | None = None):
        self.path, self.keys, self.where = path, {k.name: k for k in keys}, where
        self.unsupported = unsupported or {}

    @property
    def names(self) -> tuple:
        return tuple(self.keys)

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def default(self, name: str):
        return self.keys[name].default

    def defaults(self, names) -> tuple:
        return tuple(self.keys[n].default for n in names)

    def mapping(self, v) -> dict:
        """v as a mapping of known keys (None: {})."""
        where = self.where or self.path
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ConfigError(f"{where or 'config'}: must be a mapping, got {type(v).__name__}")
        for k in v:
            if k in self.unsupported:
                raise ConfigError(f"{where}.{k}: not supported by nettap ({self.unsupported[k]})")
            if k not in self.keys:
                at = f"{where}.{key_name(k)}" if where else key_name(k)
                raise ConfigError(f"{at}: unknown key (expected one of {', '.join(self.keys)})")
        return v

    def get(self, m: dict, name: str, default=None):
        """m's value of name (or the key's default, or default when given),
        checked."""
        k = self.keys[name]
        return k.check(m.get(name, k.default if default is None else default), self.key(name))


def rows(section: Section):
    """(key, type and bounds, default, doc) of every leaf key below section, in order."""
    for k in section.keys.values():
        if isinstance(k.check, Section):
            yield from rows(k.check)
        else:
            shown = k.shown or ("" if k.default is None else _shown(k.default))
            yield section.key(k.name), k.check.text, shown, k.doc


def _number(n: int) -> str:
    """2^30 for a large power of two, the digits otherwise."""
    return f"2^{n.bit_length() - 1}" if n >= 1 << 20 and not n & (n - 1) else str(n)


def _shown(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def table(section: Section) -> str:
    """A Markdown table of every key below section."""
    out = ["| key | type, bounds | default | |", "|---|---|---|---|"]
    for key, text, shown, doc in rows(section):
        cells = [f"`{key}`", text, f"`{shown}`" if shown else "", doc]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def json_schema(section: Section) -> dict:
    """A JSON Schema (draft-07) of a section: its keys and their types, unknown keys refused;
    what a :class:`Check` of the parser's own accepts is left to the parser. For the Helm
    chart's values.schema.json (deploy/kubernetes/render.py), so a misspelt key is refused
    at install, not by the running nettap."""
    props = {}
    for k in section.keys.values():
        c = k.check
        if isinstance(c, Section):
            s = json_schema(c)
        elif isinstance(c, Int):
            s = {"type": "integer", "minimum": c.lo, "maximum": c.hi}
        elif isinstance(c, Bool):
            s = {"type": "boolean"}
        elif isinstance(c, Choice):
            s = {"enum": list(c.choices)}
        elif isinstance(c, Str):
            s = {"type": "string", "minLength": 1}
        else:
            s = {}
        doc = k.doc or (c.text if not isinstance(c, Section) else "")
        props[k.name] = {"description": doc, **s} if doc else s
    return {"type": "object", "additionalProperties": False, "properties": props}
