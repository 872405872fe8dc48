"""The licenses said where a user or a tool looks (LICENSE and LICENSES/,
pyproject.toml's license, the README, the image's label) agree with the
sources' SPDX-License-Identifier lines, and the BPF objects declare a
license the kernel takes as GPL-compatible."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPDX = re.compile(r"SPDX-License-Identifier:\s*(.+?)\s*(?:\*/)?\s*$", re.M)
# kernel/bpf/syscall.c: bpf_prog_load -> license_is_gpl_compatible (include/linux/license.h)
GPL_COMPATIBLE = ("GPL", "GPL v2", "GPL and additional rights", "Dual BSD/GPL", "Dual MIT/GPL", "Dual MPL/GPL")


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file() and not f.startswith(("LICENSE", "tests/"))]


def _expressions() -> dict:
    """{SPDX expression: [files]} of every tracked file that has the line."""
    out = {}
    for f in _tracked():
        try:
            m = SPDX.search(f.read_text(errors="strict")[:1000])
        except (UnicodeDecodeError, OSError):
            continue
        if m:                                   # "(A OR B)" and "A OR B" are one expression
            expr = m.group(1)[1:-1] if m.group(1).startswith("(") and m.group(1).endswith(")") else m.group(1)
            out.setdefault(expr, []).append(str(f.relative_to(ROOT)))
    return out


def _package_license() -> str:
    return re.search(r'^license = \{ text = "([^"]+)" \}', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_every_identifier_has_its_text():
    exprs = _expressions()
    assert exprs == {"LGPL-2.1 OR BSD-2-Clause": exprs.get("LGPL-2.1 OR BSD-2-Clause")}, exprs.keys()
    assert all(f.startswith(("bpf/", "bench/")) for f in exprs["LGPL-2.1 OR BSD-2-Clause"])
    ids = {i for e in [*exprs, _package_license()] for i in re.findall(r"[A-Za-z0-9.\-]+", e)} - {"OR", "AND"}
    assert {p.stem for p in (ROOT / "LICENSES").glob("*.txt")} == ids
    for i in ids:
        assert i in (ROOT / "LICENSE").read_text(), i


def test_package_readme_and_image_say_the_same():
    package = _package_license()
    assert package == "Apache-2.0 AND (" + " ".join(_expressions()) + ")"
    section = (ROOT / "README.md").read_text().split("## License", 1)[1]
    assert f"`{package}`" in section and "`LGPL-2.1 OR BSD-2-Clause`" in section
    assert f'org.opencontainers.image.licenses="{package}"' in (ROOT / "Dockerfile").read_text()
    assert f"The package as a whole: {package}." in (ROOT / "LICENSE").read_text()


def test_bpf_objects_declare_a_gpl_compatible_license():
    from elftools.elf.elffile import ELFFile
    objects = sorted((ROOT / "bpf").glob("*/*.bpf.o"))        # bpf/<arch>/
    assert objects
    for obj in objects:
        with open(obj, "rb") as f:
            lic = ELFFile(f).get_section_by_name("license").data().rstrip(b"\0").decode()
        assert lic in GPL_COMPATIBLE and lic == "Dual BSD/GPL", (obj.name, lic)
        assert f"`{lic}`" in (ROOT / "README.md").read_text() and f'"{lic}"' in (ROOT / "LICENSE").read_text()
