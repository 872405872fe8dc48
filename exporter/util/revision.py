"""The git revision nettap runs: written into exporter/_revision.py when a
package is built (setup.py), else asked of git when running from a checkout
(an editable install, `python -m exporter`), else "unknown"."""
from __future__ import annotations

import os
import subprocess


def revision(package_dir: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str:
    try:
        from exporter._revision import REVISION
        return REVISION
    except ImportError:
        pass
    checkout = os.path.dirname(package_dir)
    if os.path.exists(os.path.join(checkout, ".git")):         # a directory, or a worktree's file
        try:
            out = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"
