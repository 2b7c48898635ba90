"""cachekeeper/builder/harvest.py: what a builder's own run makes of harvested deltas (issue 32)."""

from __future__ import annotations

from cachekeeper.builder.harvest import entries, entry_of, judge
from cachekeeper.environment.fingerprint import collect
from cachekeeper.snapshot.manifest import FileEntry, Manifest

FP = collect()


def _manifest(*paths: str, parent: str | None = None) -> Manifest:
    return Manifest(
        files=tuple(
            FileEntry(path=p, digest=f"{i:064x}", size_bytes=1) for i, p in enumerate(paths)
        ),
        fingerprint=FP,
        workload="w",
        source=None if parent is None else "harvest",
        parent=parent,
    )


def test_an_entry_is_an_fx_graph_or_aotautograd_key_folder() -> None:
    assert entry_of("fxgraph/ab/fabc/entry-1") == "fxgraph/ab/fabc"
    assert entry_of("aotautograd/aabc/entry") == "aotautograd/aabc"
    assert entry_of("fxgraph/ab/fabc") is None  # no file inside a key folder
    assert entry_of("triton/0/hash/kernel.so") is None
    assert entry_of("ab/cabc.py") is None
    assert entries(["fxgraph/ab/k/1", "fxgraph/ab/k/2", "aotautograd/a/x"]) == {
        "fxgraph/ab/k",
        "aotautograd/a",
    }


def test_only_entries_the_builders_own_run_compiled_are_promoted() -> None:
    warm = _manifest("fxgraph/00/old/e", "aotautograd/aold/e", "triton/0/h/k.so")
    delta = _manifest(
        "fxgraph/11/new/e",  # the builder's run compiles it too: promoted
        "fxgraph/22/only-the-job/e",  # it does not: kept back
        "fxgraph/00/old/!planted",  # a file added to an entry the snapshot has: kept back
        "triton/0/h2/k.so",  # follows from the entries, not judged
        parent=warm.id,
    )
    built = ["fxgraph/00/old/mine", "aotautograd/aold/mine", "fxgraph/11/new/mine", "x/y.py"]
    judged = judge(warm=warm, deltas=[delta], built=built)
    assert judged.publishes
    assert judged.promoted == ("fxgraph/11/new",)
    assert judged.kept_back == ("fxgraph/22/only-the-job",)
    assert judged.already == ("fxgraph/00/old",)
    assert judged.harvested == 3 and judged.deltas == (delta.id,)
    line = judged.describe()
    assert line.startswith("1 of 3 harvested FX-graph/AOTAutograd entries of 1 harvested")
    assert "compiled here by the workload's own run" in line
    assert "1 kept back: the jobs ran shapes or code the workload does not" in line
    assert "entries the snapshot already has" in line
    assert "never loaded or signed" in line


def test_nothing_is_published_when_the_builder_reproduces_none() -> None:
    warm = _manifest("fxgraph/00/old/e")
    delta = _manifest("fxgraph/22/only-the-job/e", parent=warm.id)
    judged = judge(warm=warm, deltas=[delta], built=["fxgraph/00/old/mine"])
    assert not judged.publishes and judged.kept_back == ("fxgraph/22/only-the-job",)
    assert judged.describe().startswith("none of the 1 harvested FX-graph/AOTAutograd entries")
    assert "nothing published" in judged.describe()
    assert judged.to_dict()["kept_back"] == ["fxgraph/22/only-the-job"]
