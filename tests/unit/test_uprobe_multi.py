"""exporter/kernel/uprobe_multi.py's symbol offsets, against binutils'
readelf on the system's libssl (an independent ELF reader): the offset a
uprobe is placed at is the function's address less its LOAD segment's
address plus that segment's file offset."""
import os
import shutil
import subprocess

import pytest

from exporter.kernel import tls, uprobe_multi

FILES = [os.path.realpath(f) for f in tls.system_files()]
NAMES = [s for s, _p in tls.FORGET] + [s for syms in tls.SYMBOLS.values() for s, _p in syms]


def readelf_offsets(path: str) -> dict:
    out = subprocess.run(["readelf", "-W", "--dyn-syms", "-l", path], capture_output=True, text=True,
                         check=True).stdout
    segs, addrs = [], {}
    for f in (line.split() for line in out.splitlines()):
        if f and f[0] == "LOAD":
            segs.append((int(f[1], 16), int(f[2], 16), int(f[5], 16)))
        elif len(f) >= 8 and f[3] == "FUNC" and f[6] != "UND":
            addrs.setdefault(f[7].split("@")[0], int(f[1], 16))
    return {n: a - va + off for n, a in addrs.items() if n in NAMES
            for off, va, size in segs if va <= a < va + size}


@pytest.mark.skipif(not FILES or not shutil.which("readelf"), reason="no libssl.so or no readelf here")
def test_symbol_offsets_are_readelfs():
    for f in FILES:
        got = uprobe_multi.symbol_offsets(f, NAMES + ["no_such_symbol"])
        assert got == readelf_offsets(f) and set(got) >= {"SSL_free", "SSL_read", "SSL_write"}


def test_a_file_that_is_not_elf_is_an_error_not_a_crash(tmp_path):
    (tmp_path / "libssl.so.3").write_bytes(b"\x7fELF not really")
    made, counts, error = tls.attach_multi(None, "fast", str(tmp_path / "libssl.so.3"))
    assert made == [] and not any(counts.values()) and "not an ELF file" in error
