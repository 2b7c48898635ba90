"""Run the hardening tests and print docs/reliability.md's table from what they recorded.

    .venv/bin/python scripts/reliability_report.py > docs/reliability.md
    .venv/bin/python scripts/reliability_report.py --only tests/server/resources/test_gc_races.py

``--only PATH...`` runs just those test files (their rows only), for checking new rows
without the whole run.

The tests in tests/hardening/ append one JSON row per fault or input they tried (to the
file named by CACHEKEEPER_RELIABILITY_LOG) only after their assertions passed. Attacker
inputs already tested in tests/restore/test_restore.py and tests/server/test_roundtrip.py
are run too and counted from their pytest outcomes (one try per passing case), so the
numbers in the table are always what this run did. A failing test shows as FAILED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Existing tests counted as rows: node id prefix -> (area, what was tried, outcome).
EXISTING = {
    "tests/restore/test_restore.py::test_bad_manifest_is_refused_before_writing": (
        "attacker input",
        "archive manifest with traversal, absolute path, own state dir, duplicate entry, "
        "unknown format (restore)",
        "refused",
    ),
    "tests/restore/test_restore.py::test_bad_members_are_refused_before_writing": (
        "attacker input",
        "archive member that is a symlink, hard link, device, traversal, absolute path, "
        "unknown blob, corrupt or too large (restore)",
        "refused",
    ),
    "tests/restore/test_restore.py::test_decompression_bomb_is_cut_off_at_the_declared_size": (
        "attacker input",
        "decompression bomb: 256 MiB under a blob declared as 1 byte (restore)",
        "refused",
    ),
    "tests/restore/test_restore.py::test_missing_blob_is_refused_naming_the_entry": (
        "attacker input",
        "archive missing a blob its manifest lists (restore)",
        "refused",
    ),
    "tests/restore/test_restore.py::test_not_an_archive_is_refused": (
        "attacker input",
        "file that is not an archive (restore)",
        "refused",
    ),
    "tests/restore/test_restore.py::test_race_with_another_writer_never_clobbers": (
        "concurrency",
        "another writer creates a file mid-restore (never clobbered)",
        "kept",
    ),
    "tests/restore/test_restore.py::test_eight_concurrent_restores_serialize_and_reuse": (
        "concurrency",
        "8 restore processes into one dir",
        "kept",
    ),
    "tests/client/test_prejob.py::test_state_folder_as_a_file_fails_pull_cleanly_and_prejob_cold": (
        "target dir",
        "`pull` and `prejob` with the cache dir's `.cachekeeper` a regular file: one-line "
        "error (pull), cold start saying why (prejob), the file kept",
        "refused",
    ),
    "tests/server/test_roundtrip.py::test_digest_mismatch_stores_nothing": (
        "attacker input",
        "blob upload whose bytes do not hash to its name (server)",
        "refused",
    ),
    "tests/server/test_roundtrip.py::test_bad_zstd_body_is_refused": (
        "attacker input",
        "blob upload with a corrupt zstd body (server)",
        "refused",
    ),
    "tests/server/test_roundtrip.py::test_malformed_manifests_are_refused": (
        "attacker input",
        "malformed manifests on publish: traversal, absolute, bad digests, ... (server)",
        "refused",
    ),
    "tests/server/test_roundtrip.py::test_limits_answer_413": (
        "attacker input",
        "blob, manifest and file-count limits on the server (413)",
        "refused",
    ),
    "tests/server/test_settings.py::test_served_with_an_empty_tokens_variable_auth_stays_on": (
        "configuration",
        "CACHEKEEPER_TOKENS= (empty) next to --config [tokens]: auth stays on (anonymous 401)",
        "kept",
    ),
    "tests/server/test_settings.py::test_empty_tokens_variable_keeps_the_config_files_tokens": (
        "configuration",
        "CACHEKEEPER_TOKENS empty, blank, '{}' or ',': the file's tokens kept, or refused",
        "refused",
    ),
    "tests/server/test_settings.py::test_config_errors_name_the_setting_its_source_and_value": (
        "configuration",
        "bad token scope, a size '10 parsecs', a port 'eighty', unknown config key"
        " 'anonymous_reads', bad TOML: one line naming setting, source and value",
        "refused",
    ),
    "tests/server/test_settings.py::test_an_exposed_server_without_auth_refuses_to_start": (
        "configuration",
        "serve on 0.0.0.0, ::, a LAN address or a host name with auth off and no"
        " --insecure-no-auth",
        "refused",
    ),
    "tests/server/test_settings.py::test_an_unusable_data_dir_is_one_line_naming_the_path": (
        "configuration",
        "serve --data under a regular file, read-only to the server (a root-owned bind"
        " mount), or whose meta.sqlite is a directory: one line naming path and cause",
        "refused",
    ),
    "tests/server/test_catalog.py::test_two_inserts_then_an_exception_leave_neither": (
        "transactions",
        "an exception after two inserts in one write (both roll back)",
        "kept",
    ),
    "tests/server/test_catalog.py::test_a_failed_publish_leaves_no_snapshot_and_no_references": (
        "transactions",
        "an exception after a snapshot row and 1,200 references (all roll back)",
        "kept",
    ),
    "tests/server/test_catalog.py::test_a_full_disk_is_insufficient_storage_and_rolls_back": (
        "disk full",
        "SQLite database full (max_page_count) mid-publish: insufficient_storage, rolled back",
        "refused",
    ),
    "tests/server/resources/test_gc_races.py::test_a_snapshot_pinned_after_the_plan_is_not_evicted": (
        "concurrency",
        "snapshot pinned between a capped GC's plan and its execution (not evicted)",
        "kept",
    ),
    "tests/server/resources/test_gc_races.py::test_an_orphan_uploaded_after_the_plan_keeps_its_file": (
        "concurrency",
        "orphan blob uploaded and published between GC's plan and its execution (file kept)",
        "kept",
    ),
    "tests/server/resources/test_gc_races.py::test_a_blob_row_without_its_file_is_reported_missing": (
        "server state",
        "blob row whose file is gone: reported missing, re-uploaded by the next push",
        "recovered",
    ),
    "tests/client/test_plaintext_and_tls.py::test_no_client_path_sends_the_token_in_clear_to_another_host": (
        "configuration",
        "a bearer token over plain http:// to this host's non-loopback address (push, an"
        " operator command, the Python client, the hook's POST, prejob, postjob): refused"
        " in one line, 0 connections made; sent only with --allow-plaintext",
        "refused",
    ),
    "tests/cli/test_serve.py::test_the_start_line_names_the_url_and_no_token": (
        "configuration",
        "serve with tokens from a flag, the environment and a config file: the start line"
        " is the URL, no token in any line it logs",
        "kept",
    ),
    "tests/server/resources/test_gc_and_restart.py::test_upload_cut_off_midway_leaves_no_blob": (
        "server killed",
        "client connection cut mid-upload (no blob stored)",
        "kept",
    ),
}


class _Collector:
    def __init__(self) -> None:
        self.passed: dict[str, int] = defaultdict(int)
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:  # type: ignore[no-untyped-def]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if report.passed:
                self.passed[report.nodeid] += 1
            elif report.failed:
                self.failed.append(report.nodeid)


def main(argv: list[str] | None = None) -> int:
    import pytest

    args = list(sys.argv[1:] if argv is None else argv)
    only = args[1:] if args[:1] == ["--only"] else None
    os.chdir(REPO)
    log = Path(tempfile.mkstemp(prefix="reliability-", suffix=".jsonl")[1])
    os.environ["CACHEKEEPER_RELIABILITY_LOG"] = str(log)
    collector = _Collector()
    started = time.monotonic()
    targets = [
        "tests/hardening",
        *sorted({k.split("::")[0] + "::" + k.split("::")[1] for k in EXISTING}),
    ]
    existing = EXISTING
    if only is not None:
        targets = [t for t in targets if t.split("::")[0] in only] + [
            t for t in only if t.startswith("tests/hardening")
        ]
        existing = {k: v for k, v in EXISTING.items() if k.split("::")[0] in only}
    with open(os.devnull, "w") as quiet:
        stdout = sys.stdout
        sys.stdout = quiet
        try:
            code = pytest.main(["-q", "-p", "no:cacheprovider", *targets], plugins=[collector])
        finally:
            sys.stdout = stdout
    took = time.monotonic() - started
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    log.unlink()
    for prefix, (area, fault, outcome) in existing.items():
        tries = sum(n for node, n in collector.passed.items() if node.startswith(prefix))
        failed = any(node.startswith(prefix) for node in collector.failed)
        rows.append(
            {
                "area": area,
                "fault": fault,
                "tries": tries,
                "outcome": "FAILED" if failed else outcome,
                "test": prefix,
            }
        )
    for node in collector.failed:
        if node.startswith("tests/hardening"):
            rows.append(
                {"area": "FAILED", "fault": node, "tries": 0, "outcome": "FAILED", "test": node}
            )
    rows.sort(key=lambda r: (str(r["area"]), str(r["fault"])))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print("# Reliability report\n")
    print(
        "Every row is a fault or bad input that an automated test tried in this run, how many\n"
        "times, and what happened: **kept** (the fault hit, what was there stayed intact and\n"
        "nothing partial appeared), **refused** (a clear one-line error, nothing written),\n"
        "**recovered** (after the fault, a rerun completed). Produced by\n\n"
        "    .venv/bin/python scripts/reliability_report.py > docs/reliability.md\n\n"
        f"at commit {commit} on a 2-core machine; the run took {took:.0f} s, pytest exit code {int(code)}.\n"
    )
    print("| area | fault or input | tries | outcome | test |")
    print("|---|---|---:|---|---|")
    for r in rows:
        test = str(r["test"]).split("::")
        short = f"{Path(test[0]).name}::{test[1].split('[')[0]}" if len(test) > 1 else test[0]
        print(f"| {r['area']} | {r['fault']} | {r['tries']} | {r['outcome']} | `{short}` |")
    total = sum(int(r["tries"]) for r in rows)
    print(f"\n{len(rows)} kinds of fault or input, {total} tries in all.")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
