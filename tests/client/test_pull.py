"""client/pull.py: the pull report's JSON (``pull --json``, a CLI contract)."""

from cachekeeper.client.pull import PullReport


def test_pull_report_json_keeps_its_keys_order_and_lists() -> None:
    report = PullReport(
        snapshot_id="a" * 64,
        workload="w",
        cache_dir="/c",
        outcome="restored",
        exact=True,
        verified=False,
        blobs_fetched=3,
        attempts=1,
        conflicts=("x.bin",),
        fallback_reason="presigned URL expired",
        deltas=("b" * 64,),
        delta_problems=("c: signature",),
    )
    data = report.to_dict()
    assert data == {
        "snapshot_id": "a" * 64,
        "workload": "w",
        "cache_dir": "/c",
        "outcome": "restored",
        "exact": True,
        "verified": False,
        "blobs_fetched": 3,
        "attempts": 1,
        "conflicts": ["x.bin"],
        "archive_from": "server",
        "fallback_reason": "presigned URL expired",
        "deltas": ["b" * 64],
        "delta_problems": ["c: signature"],
    }
    assert list(data) == list(PullReport.__dataclass_fields__)
