"""What the status page shows, built from the library calls the JSON routes make.

``page_data(services)`` gathers the fleet status rows (``Fleet.status``, the
function behind ``GET /v1/status``), the agents (``GET /v1/agents``) and the recent
snapshots (``GET /v1/snapshots``), and turns them into frozen dataclasses the templates
read. No SQL here and no second copy of the status rules: a cell's state is the status
row's ``status``, refined only where the row itself leaves it open:

- ``warm`` splits into ``warm_verified`` and ``warm_unverified`` (the snapshot's
  ``verified`` flag: verify found the cache effective, or nobody checked);
- ``stale``: the row's ``stale`` (``server/resources/fleet.py``): a ``warm`` row whose snapshot was
  built from another workload digest than the one registered, or a ``building`` row whose
  agent went silent. The same rule answers ``GET /v1/status`` and ``cachekeeper status``.

An environment's column reads torch, Triton, CUDA, driver, GPUs and CPU (``label``). Two
environments can read the same there and still differ (the per-key tier's switch in
torch's key, ``TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1``; a CUDA wheel; Python): then each
column also shows what separates it from the others of its label (``distinct``: the
fingerprint's fields that differ among them, provenance aside), so no two columns read
the same. A workload with no status row in a column (its agent builds it under another
environment: a ``[[command]]``'s ranks compile with their launcher's thread count) shows
an empty cell, not "missing": nothing is missing there.

The plot (``size_plot_svg``) is plain SVG text: the stored snapshots' total size over
time and, where job reports exist, restores per day.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass, replace
from datetime import datetime
from html import escape
from typing import Any

from cachekeeper.environment.fingerprint import Fingerprint, identity

from .services import Services

__all__ = [
    "Cell",
    "Environment",
    "PageData",
    "page_data",
    "distinguish",
    "size_plot_svg",
    "STATES",
    "plain",
]

# (state, label, what it means): the legend, in the order the page shows it.
STATES: tuple[tuple[str, str, str], ...] = (
    ("warm_verified", "warm, verified", "a snapshot verify found effective"),
    ("warm_unverified", "warm, unverified", "a snapshot nobody verified"),
    ("building", "building", "an agent is building it now"),
    ("broken", "cold_compile_broken", "the workload raised during a cold compile"),
    ("failed", "failed", "the last build failed (crash, timeout, push)"),
    ("refused", "refused", "the builder's allowlist does not admit the workload's code"),
    ("missing", "missing", "nothing built for this pair"),
    ("stale", "stale", "built for an older workload TOML, or its builder went silent"),
)


def plain(value: Any) -> dict[str, Any]:
    """A dict whether a library call answered a dict or a wire dataclass."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)  # nested dataclasses (a row's last_event) become dicts too
    return dict(value)


def _parse(at: str | None) -> datetime | None:
    return datetime.fromisoformat(at) if at else None


@dataclass(frozen=True, kw_only=True)
class Environment:
    """One column: a fingerprint digest and its summary line."""

    digest: str
    torch: str
    triton: str
    cuda: str
    driver: str
    gpu: str
    fingerprint: Fingerprint | None
    cpu: str = (
        "-"  # threads and vector ISA: two hosts may differ only there (cachekeeper.environment.cpu)
    )
    # what separates this column from the others with the same ``label`` (``distinct``)
    distinct: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        return self.digest[:12]

    @property
    def label(self) -> str:
        """What the column's header reads, the digest aside."""
        return (
            f"torch {self.torch} · Triton {self.triton} · CUDA {self.cuda} · driver"
            f" {self.driver} · {self.gpu} · CPU {self.cpu}"
        )


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One (workload, environment) pair with its state and the facts behind it."""

    workload: str
    digest: str
    state: str
    why: str
    row: dict[str, Any]
    snapshot: dict[str, Any] | None
    restore_rate: float | None  # restores / (restores + cold starts), from job reports
    compiled_anyway_rate: float | None  # restored jobs that compiled anyway / restores

    @property
    def reason(self) -> str:
        """A refused, broken or failed cell's reason, its first line cut to fit a cell."""
        if self.state not in ("refused", "broken", "failed"):
            return ""
        lines = self.why.strip().splitlines()
        first = lines[0].removeprefix(f"{self.row['status']}: ") if lines else ""
        return first if len(first) <= 90 else first[:87] + "..."

    @property
    def traceback(self) -> list[str]:
        event = self.row.get("last_event") or {}
        return list(event.get("traceback_tail") or [])


@dataclass(frozen=True, kw_only=True)
class PageData:
    workloads: list[str]
    environments: list[Environment]
    cells: dict[tuple[str, str], Cell]
    agents: list[dict[str, Any]]
    snapshots: list[dict[str, Any]]
    builds: dict[str, dict[str, Any]]  # agent name -> its newest building event
    now: datetime


def environment_of(digest: str, fingerprint: Fingerprint | None) -> Environment:
    """The column of ``fingerprint``: read with ``get`` and ``isinstance``, since the rows of
    agents and snapshots an older server took were checked only as JSON objects."""
    fp: Fingerprint = fingerprint or {}
    gpus = fp.get("gpus") or []
    names = sorted({str(g.get("name", "?")) for g in gpus if isinstance(g, dict)})
    gpu = f"{len(gpus)}x {', '.join(names)}" if gpus else "no GPU"
    state = fp.get("cpu")
    if not isinstance(state, dict):  # schema 1 (or such a row)
        state = None
    threads = state.get("threads") if state else None
    cpu = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "threads ?"
    if state and state.get("isa"):
        cpu += f", {state.get('isa')}"
    return Environment(
        digest=digest,
        torch=str(fp.get("torch") or "?"),
        triton=str(fp.get("triton") or "-"),
        cuda=str(fp.get("cuda") or "-"),
        driver=str(fp.get("driver") or "-"),
        gpu=gpu,
        fingerprint=fingerprint,
        cpu=cpu if state else "-",
    )


def _leaves(fingerprint: Fingerprint | None) -> dict[str, str]:
    """{field path: value as text} of the fingerprint's identity (``fingerprint.identity``:
    provenance left out), one level into objects (``env.NAME``, ``cpu.threads``)."""
    out: dict[str, str] = {}
    for name, value in identity(fingerprint or {}).items():
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                out[f"{name}.{key}"] = inner if isinstance(inner, str) else json.dumps(inner)
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


def distinguish(environments: list[Environment]) -> list[Environment]:
    """``environments`` with ``distinct`` set where columns share a ``label``: each one's
    values of the fields that differ among them (``env.X=1`` as ``X=1``, absent as unset)."""
    groups: dict[str, list[Environment]] = {}
    for env in environments:
        groups.setdefault(env.label, []).append(env)
    out = []
    for env in environments:
        group = groups[env.label]
        if len(group) < 2:
            out.append(env)
            continue
        leaves = [_leaves(e.fingerprint) for e in group]
        mine = _leaves(env.fingerprint)
        paths = sorted({p for found in leaves for p in found})
        differ = [p for p in paths if len({found.get(p) for found in leaves}) > 1]
        shown = []
        for path in differ:
            name = path.removeprefix("env.")
            shown.append(f"{name}={mine[path]}" if path in mine else f"{name} unset")
        if env.fingerprint is None:
            shown = ["fingerprint not stored"]
        out.append(replace(env, distinct=tuple(shown)))
    return out


def _rates(jobs: dict[str, Any] | None) -> tuple[float | None, float | None]:
    if not jobs:
        return None, None
    restores = int(jobs.get("restores") or 0)
    starts = restores + int(jobs.get("cold") or 0)
    restore_rate = restores / starts if starts else None
    anyway = int(jobs.get("compiled_after_restore") or 0)
    compiled_rate = anyway / restores if restores else None
    return restore_rate, compiled_rate


def _state(row: dict[str, Any], snapshot: dict[str, Any] | None) -> tuple[str, str]:
    status = row["status"]
    if row.get("stale"):
        return "stale", str(row["stale"])
    if status == "warm":
        if snapshot is not None and not snapshot["verified"]:
            return "warm_unverified", "the snapshot was never verified effective"
        return "warm_verified", "a verified snapshot serves this pair"
    if status == "building":
        return "building", "an agent reported a build in progress"
    event = row.get("last_event") or {}
    return status, str(event.get("detail") or "")


def page_data(services: Services, *, snapshot_limit: int = 20) -> PageData:
    """Everything the page shows, from the same calls as the JSON routes."""
    now = datetime.now().astimezone()
    rows = [plain(r) for r in services.fleet.status()]
    agents = [plain(a) for a in services.agents.list_all()]
    summaries = [plain(s) for s in services.snapshots.summaries(limit=10_000)]
    by_id = {s["id"]: s for s in summaries}
    workload_rows = [plain(w) for w in services.workloads.list_all()]
    fingerprints: dict[str, Fingerprint] = {}
    for agent in agents:
        fingerprints.setdefault(agent["fingerprint_digest"], agent["fingerprint"])
    cells: dict[tuple[str, str], Cell] = {}
    builds: dict[str, dict[str, Any]] = {}
    for row in rows:
        snapshot = by_id.get(row["snapshot_id"] or "")
        state, why = _state(row, snapshot)
        restore_rate, compiled_rate = _rates(row.get("jobs"))
        cells[(row["workload"], row["fingerprint_digest"])] = Cell(
            workload=row["workload"],
            digest=row["fingerprint_digest"],
            state=state,
            why=why,
            row=row,
            snapshot=snapshot,
            restore_rate=restore_rate,
            compiled_anyway_rate=compiled_rate,
        )
        event = row.get("last_event")
        if row["status"] == "building" and event:
            for name in [a["name"] for a in agents if a["id"] == event["agent_id"]]:
                builds[name] = event
    for digest in {r["fingerprint_digest"] for r in rows} - set(fingerprints):
        recorded = services.snapshots.fingerprint_of(digest)
        if recorded is not None:
            fingerprints[digest] = recorded
    environments = distinguish(
        [
            environment_of(d, fingerprints.get(d))
            for d in sorted({r["fingerprint_digest"] for r in rows})
        ]
    )
    workloads = sorted({w["name"] for w in workload_rows} | {r["workload"] for r in rows})
    return PageData(
        workloads=workloads,
        environments=environments,
        cells=cells,
        agents=agents,
        snapshots=summaries[:snapshot_limit],
        builds=builds,
        now=now,
    )


def size_plot_svg(
    snapshots: list[dict[str, Any]],
    restores_by_day: list[tuple[str, int]],
    *,
    width: int = 560,
    height: int = 160,
) -> str:
    """The stored snapshots' total size over time (a step line) and restores per day (bars)."""
    pad = 36
    points = sorted((s["created_at"], int(s["size_bytes"] or 0)) for s in snapshots)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="cache size and restores over time">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa" stroke="#ddd"/>',
    ]
    if not points:
        parts.append(
            f'<text x="{width // 2}" y="{height // 2}" text-anchor="middle" fill="#888">'
            "no snapshots stored yet</text></svg>"
        )
        return "".join(parts)
    times = [_parse(at) for at, _ in points] + [
        _parse(d + "T00:00:00+00:00") for d, _ in restores_by_day
    ]
    stamps = [t.timestamp() for t in times if t is not None]
    start, end = min(stamps), max(stamps)
    span = max(end - start, 1.0)
    total = sum(size for _, size in points)
    plot_w, plot_h = width - 2 * pad, height - 2 * pad

    def x_of(stamp: float) -> float:
        return pad + (stamp - start) / span * plot_w if end > start else pad + plot_w / 2

    if restores_by_day:
        most = max(n for _, n in restores_by_day) or 1
        for day, n in restores_by_day:
            when = _parse(day + "T00:00:00+00:00")
            assert when is not None
            bar = n / most * plot_h
            parts.append(
                f'<rect class="restores" x="{x_of(when.timestamp()) - 3:.1f}"'
                f' y="{pad + plot_h - bar:.1f}" width="6" height="{bar:.1f}" fill="#9ecae1">'
                f"<title>{escape(day)}: {n} restores</title></rect>"
            )
    running = 0
    bottom = pad + plot_h
    path: list[str] = []
    dots: list[str] = []
    for at, size in points:  # a step line: the total jumps at each publication
        when = _parse(at)
        assert when is not None
        x = x_of(when.timestamp())
        path.append(f"{'M' if not path else 'L'}{x:.1f},{bottom - running / total * plot_h:.1f}")
        running += size
        y = bottom - running / total * plot_h
        path.append(f"L{x:.1f},{y:.1f}")
        dots.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#3182bd">'
            f"<title>{escape(at[:19])}: {escape(human_bytes(running))}</title></circle>"
        )
    path.append(f"L{pad + plot_w:.1f},{bottom - plot_h:.1f}")
    parts.append(
        f'<line x1="{pad}" y1="{bottom}" x2="{pad + plot_w}" y2="{bottom}" stroke="#bbb"/>'
    )
    parts.append(
        f'<path class="size" d="{" ".join(path)}" fill="none" stroke="#3182bd" stroke-width="2"/>'
    )
    parts += dots
    first, last = points[0][0][:10], points[-1][0][:10]
    parts += [
        f'<text x="{pad}" y="{height - 10}" font-size="11" fill="#555">{escape(first)}</text>',
        f'<text x="{width - pad}" y="{height - 10}" font-size="11" fill="#555"'
        f' text-anchor="end">{escape(last)}</text>',
        f'<text x="{pad}" y="{pad - 10}" font-size="11" fill="#3182bd">stored size:'
        f" {escape(human_bytes(total))}</text>",
        f'<text x="{width - pad}" y="{pad - 10}" font-size="11" fill="#6baed6" text-anchor="end">'
        + (
            f"restores: {sum(n for _, n in restores_by_day)}"
            if restores_by_day
            else "restores: no job reports yet"
        )
        + "</text>",
        "</svg>",
    ]
    return "".join(parts)


def human_bytes(n: int | None) -> str:
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fingerprint_json(fingerprint: Fingerprint | None) -> str:
    return json.dumps(fingerprint, indent=2, sort_keys=True) if fingerprint else "(unknown)"
