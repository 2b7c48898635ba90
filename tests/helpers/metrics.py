"""Reading a server's ``/metrics`` (Prometheus text) the way an operator's scraper does."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["sample", "scrape"]


def scrape(client: httpx.Client, name: str, *, token: str | None = None) -> float:
    """The sum of every sample of ``name`` (all its label sets) on ``client``'s /metrics.

    ``token``: a read-scope token, for a server with auth on (/metrics needs it).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = client.get("/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    samples = re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", answer.text, re.MULTILINE)
    return sum(float(m.group(1)) for m in samples)


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` in the exposition ``text``,
    parsed as Prometheus does (``1`` and ``1.0`` alike); None when there is none."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None
