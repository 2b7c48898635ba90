"""Reading a server's ``/metrics`` (Prometheus text) the way an operator's scraper does."""

from __future__ import annotations

import re

import httpx

__all__ = ["scrape"]


def scrape(client: httpx.Client, name: str, *, token: str | None = None) -> float:
    """The sum of every sample of ``name`` (all its label sets) on ``client``'s /metrics.

    ``token``: a read-scope token, for a server with auth on (/metrics needs it).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = client.get("/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    samples = re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", answer.text, re.MULTILINE)
    return sum(float(m.group(1)) for m in samples)
