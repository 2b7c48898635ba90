"""A harvest on a builder: a hint of what to compile, never bytes a signing process loads.

A harvested delta (``postjob --push``) holds what one training job compiled on top of a
snapshot. Cache entries are code (torch unpickles FX-graph and AOTAutograd entries and
imports the generated modules), and any write token can publish a delta, with any bytes
in it. So the rule (issue 32; docs/security.md): **a signing builder signs only bytes that
it compiled itself in that round**. The agent never restores a harvest, never lets torch
load one, never signs one. What it takes from a delta is its manifest (JSON, validated by
``Manifest``; no blob is fetched) and, from that, the names of the entries it holds
(``entries``)::

    fxgraph/<xx>/<key>      an FX-graph cache entry (torch looks compiled graphs up by key)
    aotautograd/<key>       an AOTAutograd cache entry

Its Triton kernels and generated modules follow from those entries and are not judged.
The agent then compiles the workload itself, cold, in a fresh empty dir (an ordinary
prewarm and verify) and ``judge`` compares the names:

- **promoted**: harvested entries its own run compiled and the warm snapshot lacks. The
  builder publishes its *own* build, signed, as a new verified snapshot: nodes get those
  entries as the builder compiled them, not as the node sent them.
- **already in the snapshot**: harvested entries the warm snapshot holds already. A job
  that hit an entry writes nothing there, so a delta that adds files to one is kept back
  and named (the issue's attack planted a pickle in such a folder).
- **kept back**: harvested entries the builder's run did not compile. Never published.

How a workload can reproduce a harvest, honestly: only by compiling the same entries. An
entry's key is a hash of the traced graph, its inputs' shapes and the configuration;
cachekeeper cannot turn a key back into a shape without loading the entry (running it).
A ``[[command]]`` runs the site's launcher with fixed arguments, so its run compiles
again what it compiled before, unless what the launcher runs depends on something outside
the workload file (its own config, a dataset) that now reaches those shapes. Usually a
harvest is a report: the jobs run shapes the workload does not. Add them (the command's
arguments, ``seq_lens``), and the agent builds the new workload text itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cachekeeper.snapshot.manifest import Manifest

__all__ = ["ENTRY_DEPTH", "HarvestJudgement", "entries", "entry_of", "judge"]

# The top folder of an entry kind, and how many path parts name one entry.
ENTRY_DEPTH = {"fxgraph": 3, "aotautograd": 2}


def entry_of(path: str) -> str | None:
    """The FX-graph or AOTAutograd entry a snapshot path belongs to, or None."""
    parts = path.split("/")
    depth = ENTRY_DEPTH.get(parts[0])
    if depth is None or len(parts) <= depth:
        return None
    return "/".join(parts[:depth])


def entries(paths: Iterable[str]) -> frozenset[str]:
    """The FX-graph and AOTAutograd entries among ``paths``."""
    return frozenset(e for e in map(entry_of, paths) if e is not None)


@dataclass(frozen=True)
class HarvestJudgement:
    """What a builder's own run made of the harvested deltas of its warm snapshot."""

    parent: str  # the warm snapshot's id
    deltas: tuple[str, ...]  # the harvested deltas' ids
    harvested: int  # FX-graph and AOTAutograd entries the deltas name
    promoted: tuple[str, ...]  # compiled here, not in the warm snapshot: published, ours
    already: tuple[str, ...]  # in the warm snapshot already: a delta adds files to them
    kept_back: tuple[str, ...]  # not compiled here: never published by the builder

    @property
    def publishes(self) -> bool:
        """Whether the builder's own build is worth publishing: it adds harvested entries."""
        return bool(self.promoted)

    def describe(self) -> str:
        """One line for the agent's outcome (the status page and ``cachekeeper status``)."""
        of = f"of {len(self.deltas)} harvested delta(s) of snapshot {self.parent[:12]}"
        parts = [
            f"{len(self.promoted)} of {self.harvested} harvested FX-graph/AOTAutograd entries"
            f" {of} compiled here by the workload's own run and published as the builder's"
            " own bytes"
            if self.promoted
            else f"none of the {self.harvested} harvested FX-graph/AOTAutograd entries {of}"
            " was compiled by the workload's own run: nothing published"
        ]
        if self.kept_back:
            parts.append(
                f"{len(self.kept_back)} kept back: the jobs ran shapes or code the workload"
                " does not; add them to the workload (docs/workloads.md, harvests)"
            )
        if self.already:
            parts.append(
                f"{len(self.already)} kept back: the delta adds files to entries the snapshot"
                " already has (a job that hit writes none there)"
            )
        return "; ".join(parts) + "; harvested bytes are never loaded or signed by a builder"

    def to_dict(self) -> dict[str, Any]:
        return {
            "parent": self.parent,
            "deltas": list(self.deltas),
            "harvested": self.harvested,
            "promoted": list(self.promoted),
            "already": list(self.already),
            "kept_back": list(self.kept_back),
        }


def judge(*, warm: Manifest, deltas: Sequence[Manifest], built: Iterable[str]) -> HarvestJudgement:
    """Compare the entries ``deltas`` name with those the builder's own run left (``built``:
    paths of its fresh cache dir) and those of its ``warm`` snapshot."""
    harvested = entries(f.path for d in deltas for f in d.files)
    own = entries(built)
    have = entries(f.path for f in warm.files)
    return HarvestJudgement(
        parent=warm.id,
        deltas=tuple(d.id for d in deltas),
        harvested=len(harvested),
        promoted=tuple(sorted((harvested & own) - have)),
        already=tuple(sorted(harvested & have)),
        kept_back=tuple(sorted(harvested - own - have)),
    )
