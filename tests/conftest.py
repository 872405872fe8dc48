import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def pytest_collection_modifyitems(config, items):
    """Kernel and e2e tests need root; without it they are skipped with the
    reason, so unit tests stay runnable by anyone (CI runs as root)."""
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: loads BPF programs into the running kernel")
    for item in items:
        if "kernel" in item.keywords or "e2e" in item.keywords:
            item.add_marker(skip)
