"""What nettap was built from: the git revision and branch, who built it and
when. Written into exporter/_revision.py when a package is built (setup.py);
from a checkout (an editable install, `python -m exporter`) the revision and
branch are asked of git and the builder and date are unknown; else all are
"unknown"."""
from __future__ import annotations

import os
import subprocess
from typing import Dict

UNKNOWN = "unknown"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(package_dir: str = _PACKAGE) -> Dict[str, str]:
    """{revision, branch, build_user, build_date}."""
    try:
        from exporter import _revision as built
        return {"revision": built.REVISION, "branch": getattr(built, "BRANCH", UNKNOWN),      # (a build before them)
                "build_user": getattr(built, "BUILD_USER", UNKNOWN),
                "build_date": getattr(built, "BUILD_DATE", UNKNOWN)}
    except ImportError:
        pass
    out = {"revision": UNKNOWN, "branch": UNKNOWN, "build_user": UNKNOWN, "build_date": UNKNOWN}
    checkout = os.path.dirname(package_dir)
    if os.path.exists(os.path.join(checkout, ".git")):         # a directory, or a worktree's file
        try:
            git = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD", "--abbrev-ref", "HEAD"],
                                 capture_output=True, text=True, timeout=5)
            lines = git.stdout.split()
            if git.returncode == 0 and len(lines) == 2:
                out["revision"], out["branch"] = lines
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def revision(package_dir: str = _PACKAGE) -> str:
    return build(package_dir)["revision"]
