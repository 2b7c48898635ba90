"""client/push.py: the push report's JSON (``push --json``, a CLI contract)."""

from cachekeeper.client.push import PushReport


def test_push_report_json_is_its_fields_in_order() -> None:
    report = PushReport(
        snapshot_id="a" * 64,
        workload="w",
        created=True,
        file_count=2,
        blob_count=2,
        uploaded_blobs=1,
        uploaded_bytes=10,
        uploaded_wire_bytes=7,
        deduplicated_blobs=1,
        deduplicated_bytes=5,
        unverified_reason="not prewarmed",
    )
    assert list(report.to_dict().items()) == [
        ("snapshot_id", "a" * 64),
        ("workload", "w"),
        ("created", True),
        ("file_count", 2),
        ("blob_count", 2),
        ("uploaded_blobs", 1),
        ("uploaded_bytes", 10),
        ("uploaded_wire_bytes", 7),
        ("deduplicated_blobs", 1),
        ("deduplicated_bytes", 5),
        ("verified", False),
        ("unverified_reason", "not prewarmed"),
    ]
