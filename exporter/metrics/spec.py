"""What the collectors of this package share: a family per row of a SPECS
table (kind, name, doc, labels), built fresh for each scrape."""
from __future__ import annotations

from typing import List

from prometheus_client.core import Metric


def families(specs) -> List[Metric]:
    return [kind(name, doc, labels=labels) for kind, name, doc, labels in specs]
