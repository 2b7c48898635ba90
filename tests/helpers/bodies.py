"""JSON bodies as the server sends them, for tests that parse answers without a server."""

from __future__ import annotations

from typing import Any

__all__ = ["summary_body"]


def summary_body(snapshot_id: str = "a" * 64, **changes: Any) -> dict[str, Any]:
    """A snapshot's ``Summary`` (docs/api.md), with ``changes`` applied to its fields."""
    return {
        "id": snapshot_id,
        "workload": "w",
        "fingerprint_digest": "f" * 64,
        "devices": ["cpu"],
        "verified": True,
        "signed": False,
        "size_bytes": 10,
        "file_count": 1,
        "created_at": "2026-01-01T00:00:00Z",
        "last_used_at": None,
        "pinned": False,
        "source": None,
        "parent": None,
        **changes,
    }
