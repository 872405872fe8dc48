"""The tree is the architecture (docs/architecture.md): exporter/ is layers, and
an import goes down, never up or sideways. Every import counts, the ones inside
functions too: a lazy import is still a dependency."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "exporter"

# What each layer may import besides itself (and the package root's
# __version__ / _revision, which every layer may read).
ALLOWED = {
    "util": set(),
    "kernel": {"util"},
    "config": {"util", "kernel"},
    "capture": {"util", "kernel", "config"},
    "metrics": {"util", "kernel", "config"},
    "web": {"util", "config"},
    "ingest": {"util", "config", "capture"},
    "commands": {"util", "kernel", "config", "capture", "metrics", "web", "ingest"},
}
ROOT_MODULES = {"__init__", "__main__", "config", "_revision"}


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    """exporter.capture.sinks -> capture; exporter.config -> config; the
    package root (exporter, exporter._revision) -> None."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("_revision",):
        return None
    if parts[1] == "__main__":
        return "commands"
    return parts[1]


def _imports(path: Path, mod: str | None = None) -> set:
    """Every exporter module path (module mod) imports, absolute or relative."""
    mod = mod or _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "exporter")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "exporter":
                continue
            for a in node.names:            # `from exporter.kernel import loader`: the module
                sub = f"{target}.{a.name}"  # (or a compiled one, by its C source: _native.c)
                is_module = any((PKG.parent / (sub.replace(".", "/") + ext)).exists() for ext in (".py", ".c")) or \
                    (PKG.parent / sub.replace(".", "/")).is_dir()
                out.add(sub if is_module else target)
    return out


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}
GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_module_is_in_a_layer():
    top = {m.split(".")[1] for m in MODULES if m.count(".") == 1}
    stray = top - ROOT_MODULES - set(ALLOWED)
    assert not stray, f"modules at exporter/'s top level outside any layer: {sorted(stray)}"
    assert set(ALLOWED) - {"config"} <= {p.name for p in PKG.iterdir() if p.is_dir()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down(module):
    own = _layer(module)
    if own is None:                                 # the package root imports nothing of its own
        assert all(_layer(t) is None for t in GRAPH[module]), GRAPH[module]
        return
    wrong = sorted(t for t in GRAPH[module]
                   if _layer(t) not in (None, own) and _layer(t) not in ALLOWED[own])
    assert not wrong, f"{module} ({own}) imports {wrong}: only {sorted(ALLOWED[own]) or 'nothing'} may be"


def test_no_import_cycles():
    """No two modules import each other, directly or around a loop (read and
    pcap once did): a cycle is two modules that cannot be understood apart."""
    edges = {m: {t for t in ts if t in MODULES and t != m} for m, ts in GRAPH.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                loop = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(loop))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_private_modules_stay_in_their_layer():
    """A module named _x (the compiled ones: capture's _jsonl, ingest's _split,
    kernel's _native) is its layer's own: another layer that needs what it does
    asks a public module of that layer, or has its own (ingest's line split once
    lived in capture's _jsonl)."""
    wrong = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() for t in ts
                   if t.rsplit(".", 1)[-1].startswith("_") and _layer(t) is not None and _layer(t) != _layer(m))
    assert not wrong, wrong


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk above finds what it must: a kernel module importing capture,
    lazily, and relatively."""
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    from exporter.capture import sinks\n    from ..web import server\n")
    found = _imports(bad, "exporter.kernel.probe")
    assert {"exporter.capture.sinks", "exporter.web.server"} <= found
    bad.write_text("from exporter.capture import _jsonl\n")       # a compiled module, by its source
    assert _imports(bad, "exporter.ingest.probe") == {"exporter.capture._jsonl"}
    assert not {_layer(t) for t in found} & ALLOWED["kernel"]


# A module is read whole and a function at a glance (docs/architecture.md):
# past these, split by job, as cli/start, server/transport, loader/mechanisms
# and targets/filter were. The scripts, benchmarks and tests are held to the
# issue-46 bound for every function of the tree (100 lines), the package to its own.
MODULE_LINES, FUNCTION_LINES, SCRIPT_FUNCTION_LINES = 450, 80, 100
SCRIPTS = sorted((PKG.parent / "scripts").glob("*.py")) + sorted((PKG.parent / "bench").glob("*.py")) \
    + sorted((PKG.parent / "tests").rglob("*.py"))


def _long_functions(source: str, limit: int) -> list:
    """(name, lines) of the functions of source longer than limit lines."""
    return [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(ast.parse(source))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > limit]


def _generated(source: str) -> bool:
    """A module gen_layout.py writes (tcp_h.py, programs_h.py): a table that grows
    a row a record kind or program, not code to read at a glance; its functions
    are still held to the rule."""
    return "GENERATED by scripts/gen_layout.py" in source.split("\n\n", 1)[0]


def test_modules_and_functions_stay_small():
    big = [f"{m}: {n} lines" for m, p in MODULES.items()
           if (n := len(p.read_text().splitlines())) > MODULE_LINES and not _generated(p.read_text())]
    long_ = [f"{m}.{name}: {n} lines" for m, p in MODULES.items()
             for name, n in _long_functions(p.read_text(), FUNCTION_LINES)]
    long_ += [f"{p.relative_to(PKG.parent)}: {name}: {n} lines" for p in SCRIPTS
              for name, n in _long_functions(p.read_text(), SCRIPT_FUNCTION_LINES)]
    assert SCRIPTS and not big and not long_, big + long_


def test_the_size_rule_sees_a_long_function():
    """A function of 101 lines (and a nested one) is caught; 100 lines pass."""
    body = "".join(f"    x{i} = {i}\n" for i in range(98))
    assert _long_functions(f"def ok():\n{body}    return 0\n", 100) == []
    assert _long_functions(f"def long():\n{body}    x = 1\n    return x\n", 100) == [("long", 101)]
    nested = ("class C:\n    async def m(self):\n" + body.replace("    ", "        ")
              + "        x = 1\n        return x\n")
    assert _long_functions(nested, 100) == [("m", 101)]


# The C extensions (exporter/**/*.c) and the BPF sources (bpf/*.[ch]) too: no function over C_FUNCTION_LINES, from
# the line of its name to its closing brace (the writer's threaded code, one label
# per JSON form, is the longest).
C_FUNCTION_LINES = 100
_C_BLANKED = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|^[ \t]*#(?:[^\n]*\\\n)*[^\n]*',
                        re.S | re.M)


def c_functions(text: str) -> list:
    """(name, first line, lines) of every function defined in C source text: a
    brace at file level after a parameter list. Comments, strings, character
    constants and preprocessor lines (a macro's braces) are blanked first."""
    code = _C_BLANKED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    out, depth, start = [], 0, None
    for i, c in enumerate(code):
        if c == "{":
            if depth == 0 and code[:i].rstrip().endswith(")"):
                close, level = len(code[:i].rstrip()) - 1, 0
                for j in range(close, -1, -1):          # the parameter list's opening parenthesis
                    level += {")": 1, "(": -1}.get(code[j], 0)
                    if level == 0:
                        break
                name = re.search(r"(\w+)\s*$", code[:j])
                start = (name.group(1), code.count("\n", 0, name.start(1)) + 1)
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and start:
                out.append((start[0], start[1], code.count("\n", 0, i) + 2 - start[1]))
                start = None
    return out


def test_c_functions_stay_small():
    sources = sorted(PKG.rglob("*.c")) + sorted((PKG.parent / "bpf").glob("*.[ch]"))    # the BPF side too
    assert sources
    long_ = [f"{p.relative_to(PKG.parent)}:{line} {name}: {n} lines" for p in sources
             for name, line, n in c_functions(p.read_text()) if n > C_FUNCTION_LINES]
    assert not long_, long_


def test_the_c_checker_sees_a_long_function():
    """The walk above counts what it must: a function of C_FUNCTION_LINES + 1
    lines among braces that are no function's (a struct, a macro, strings and
    comments holding braces)."""
    body = "".join(f"    x += {i};\n" for i in range(C_FUNCTION_LINES - 4))
    text = ("struct s { int a; };\n#define M() do { \\\n} while (0)\n"
            "static int shorter(int x)\n{\n    return x ? '{' : '}'; /* { */\n}\n\n"
            f"PyObject *longer(int x,\n                int y)\n{{\n{body}    return \"}}\";\n}}\n")
    assert c_functions(text) == [("shorter", 4, 4), ("longer", 9, C_FUNCTION_LINES + 1)]
