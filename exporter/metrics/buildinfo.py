"""nettap_build_info (the version, revision and platform) and `--version`'s
text, from the same fields."""
from __future__ import annotations

import platform
from typing import Callable, Dict, Iterable, Optional

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.kernel import libbpf
from exporter.util import revision

LABELS = ("version", "revision", "kernel_release", "libbpf_version", "python_version")
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}      # platform as Go programs print it


def platform_fields() -> Dict[str, str]:
    """What this process runs: nettap's version, the kernel, libbpf, Python."""
    return {"version": __version__, "kernel_release": platform.release(), "libbpf_version": libbpf.version(),
            "python_version": platform.python_version()}


def version_text(program: str, build: Optional[Callable[[], Dict[str, str]]] = None) -> str:
    """--version, laid out as Prometheus' tools print theirs (prometheus/common's
    version.Print), with Python's and libbpf's versions where they print Go's."""
    f = {**platform_fields(), **(build or revision.build)()}
    machine = platform.machine()
    return (f"{program}, version {f['version']} (branch: {f['branch']}, revision: {f['revision']})\n"
            f"  build user:       {f['build_user']}\n"
            f"  build date:       {f['build_date']}\n"
            f"  python version:   {f['python_version']}\n"
            f"  libbpf version:   {f['libbpf_version']}\n"
            f"  platform:         {platform.system().lower()}/{_GOARCH.get(machine, machine)}\n")


class BuildInfoCollector(Collector):
    def __init__(self, rev: Callable[[], str] = None):
        self._info = platform_fields()
        self._revision = rev
        self._rev = None

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("nettap_build_info", "nettap build and platform; value 1.", labels=list(LABELS))

    def collect(self) -> Iterable[Metric]:
        if self._rev is None:       # at the first scrape: from a checkout it runs git (~2 ms), off the start path
            self._rev = (self._revision or revision.revision)()
        g = self._family()
        g.add_metric([self._rev if k == "revision" else self._info[k] for k in LABELS], 1)
        return [g]
