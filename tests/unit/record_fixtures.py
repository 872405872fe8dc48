"""The recorded ring-record fixtures and their generator, shared by the
tests that decode them (test_records, test_decode)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "records"

_spec = importlib.util.spec_from_file_location("make_fixture", FIX / "make_fixture.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)

KINDS = list(mf.FILES)                            # one fixture per record kind


def ring_of(kind: str) -> str:
    """The ring a record kind is published on."""
    from exporter.kernel import tcp_h
    return tcp_h.RECORDS[kind][0]
