"""Job reports (``POST /v1/reports``, docs/api.md) and their totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from ._core import NAME_PATTERN, Check, Count, Digest, JobOutcome, JobPhase

TierPath = Literal["cachekeeper", "redis"]

# -- job reports (docs/api.md) ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobReport:
    """``POST /v1/reports``: what one end of a training job saw on one node.

    ``prejob``: the restore (``restored``, ``already_restored``) or a ``cold`` start with
    its ``reason`` (text) and ``reason_code`` (the error code). ``postjob``: what the job
    compiled on top of the restored snapshot (``compiled``, with the ``new_*`` counts and
    bytes) or nothing (``clean``).
    """

    phase: JobPhase
    outcome: JobOutcome
    workload: Annotated[str, Check(pattern=NAME_PATTERN)]
    fingerprint_digest: Digest
    snapshot_id: Digest | None = None
    node: Annotated[str, Check(max_length=256)] = ""
    devices: Annotated[list[Annotated[str, Check(max_length=32)]], Check(max_length=1024)] = field(
        default_factory=list
    )
    reason: Annotated[str, Check(max_length=2000)] | None = None
    reason_code: Annotated[str, Check(pattern=r"^[a-z_]{1,64}$")] | None = None
    new_fxgraph: Count = 0
    new_aotautograd: Count = 0
    new_triton: Count = 0
    new_other: Count = 0  # files of Inductor's code cache and the rest
    new_bytes: Count = 0
    started_at: Annotated[str, Check(max_length=64)] | None = None
    finished_at: Annotated[str, Check(max_length=64)] | None = None
    # The job this report belongs to (``slurm:<job id>``, ``torchelastic:<run id>``, or the
    # id the job's first prejob left in the cache dir): the reports of one job on one node
    # (each rank's prejob, a postjob run twice) count as one job.
    job: Annotated[str, Check(max_length=128)] | None = None
    # postjob, for a job its prejob put on the per-key tier: the path ("cachekeeper": our
    # backend, "redis": torch's stock path), the FX graph and AOTAutograd entries that came
    # from the snapshots (the cache dir) and from the tier, the puts the tier stored, the
    # calls that failed, and a problem ("tier on but 0 requests", with its likely cause).
    tier: TierPath | None = None
    snapshot_hits: Count = 0
    tier_hits: Count = 0
    tier_puts: Count = 0
    tier_failed: Count = 0
    tier_problem: Annotated[str, Check(max_length=2000)] | None = None


@dataclass(frozen=True, kw_only=True)
class JobReportAnswer:
    id: int
    at: str
    # The report names a workload nobody registered and no snapshot names (a misspelt
    # ``--workload``): why, with a did-you-mean. It is stored, and counts in no status row.
    warning: str | None = None


@dataclass(frozen=True, kw_only=True)
class JobStats:
    """The job reports of one (workload, fingerprint digest), added up (a status row's ``jobs``)."""

    workload: str
    fingerprint_digest: str
    restores: int  # prejob restored a snapshot (or found it already there)
    cold: int  # prejob started cold
    cold_reasons: dict[str, int]  # reason_code -> count
    postjobs: int  # postjob reports
    compiled: int  # postjob reports with new entries
    compiled_after_restore: int  # of those, jobs that had a snapshot restored
    new_graphs: int  # FX-graph + AOTAutograd entries those jobs compiled
    new_bytes: int
    last_report_at: str
    # The distinct tokens whose reports these are (each report is attributed to the token
    # that sent it; 0 on a server with auth off): what a token can add is bounded per
    # window (server/budgets.py), so numbers from one token are numbers one node group said.
    reporters: int = 0
    # The per-key tier over the postjobs that used it (JobReport's tier_* fields).
    tier_jobs: int = 0
    snapshot_hits: int = 0
    tier_hits: int = 0
    tier_puts: int = 0
    tier_failed: int = 0
    tier_problems: int = 0  # jobs whose tier was on but failed or asked nothing
    tier_problem: str | None = None  # the latest one

    @property
    def tier_note(self) -> str | None:
        """The per-key tier over these jobs, in a line (None when no job used it)."""
        if not self.tier_jobs:
            return None
        line = (
            f"per-key tier over {self.tier_jobs} job(s): {self.snapshot_hits} entr(ies) from"
            f" snapshots, {self.tier_hits} from the tier, {self.tier_puts} put into it,"
            f" {self.tier_failed} failed"
        )
        if self.tier_problems:
            line += f"; {self.tier_problems} job(s) with a problem, latest: {self.tier_problem}"
        return line

    @property
    def mismatch_note(self) -> str | None:
        """What a restored-but-compiled-anyway count means, or None."""
        if not self.compiled_after_restore:
            return None
        return (
            f"restored, but {self.compiled_after_restore} job(s) compiled {self.new_graphs}"
            " graph(s) anyway: the workload file does not match training; run `cachekeeper"
            " explain` and see docs/workloads.md"
        )
