"""deploy/systemd/nettap.service: the capabilities README.md's Privileges
table lists, no more, no fewer; no_new_privs; the state directory the
capture files go in by default; the config nettap is started with; and
systemd's own check of the unit, where systemd-analyze is installed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.config import DEFAULT_OUTPUT_ROOT
from exporter.kernel import privileges

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "nettap.service"
SYSUSERS = ROOT / "deploy" / "systemd" / "nettap.sysusers.conf"


def service() -> dict:
    """The [Service] section's keys (a key given twice: its values joined)."""
    out, section = {}, None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            k, _, v = line.partition("=")
            out[k] = f"{out[k]} {v}" if k in out else v
    return out


def readme_capabilities() -> set:
    section = (ROOT / "README.md").read_text().split("## Privileges", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(CAP_[A-Z_]+)` \|", section, re.M))


def test_capabilities_are_the_readmes():
    table = readme_capabilities()
    assert len(table) == 7 and set(privileges.REQUIRED) < table        # the table was found
    assert table <= set(privileges.CAPS)                               # names the kernel has
    s = service()
    assert set(s["AmbientCapabilities"].split()) == table
    assert set(s["CapabilityBoundingSet"].split()) == table
    assert s["NoNewPrivileges"] == "yes"


def test_not_root_and_where_it_reads_and_writes():
    s = service()
    assert s["User"] == "nettap" and s["User"] in SYSUSERS.read_text().split()
    assert f"/var/lib/{s['StateDirectory']}" == DEFAULT_OUTPUT_ROOT    # output.root: the capture files
    config = re.search(r"--config (\S+)", s["ExecStart"]).group(1)
    assert Path(config).parent == Path("/etc") / s["ConfigurationDirectory"]
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"                 # nettap reloads on SIGHUP


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    """systemd's check (every key known, each value parsed), with ExecStart
    pointing at this checkout's nettap (it checks the file is executable)."""
    nettap = Path(sys.executable).parent / "nettap"
    assert nettap.exists(), "nettap's entry point in this interpreter's environment"
    unit = tmp_path / "nettap.service"
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={nettap}", UNIT.read_text(), flags=re.M))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
