"""Built-in mask/score mods and factories named by import path (no compiles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekeeper import mods
from cachekeeper.errors import WorkloadInvalid


def test_mod_factories_resolve_and_refuse(tmp_path: Path) -> None:
    assert mods.build_mask_mod("none", {}, field="f") is None
    mask = mods.build_mask_mod("sliding_window", {"window": 4}, field="f")
    assert mask is not None and mask(0, 0, 10, 7) and not mask(0, 0, 10, 6)
    doc = mods.build_mask_mod("document_causal", {"doc_len": 8}, field="f")
    assert doc is not None and doc(0, 0, 9, 8) and not doc(0, 0, 9, 7) and not doc(0, 0, 8, 9)
    prefix = mods.build_mask_mod("prefix_lm", {"prefix_len": 4}, field="f")
    assert prefix is not None and prefix(0, 0, 1, 3) and not prefix(0, 0, 5, 6)
    with pytest.raises(
        WorkloadInvalid, match=r"attention\[2\].mask: cannot import module 'no_such_pkg_xyz.m'"
    ):
        mods.build_mask_mod("no_such_pkg_xyz.m:f", {}, field="attention[2].mask")
    with pytest.raises(WorkloadInvalid, match=r"f: 'cachekeeper.mods:nope': no attribute 'nope'"):
        mods.load_object("cachekeeper.mods:nope", field="f")
    with pytest.raises(WorkloadInvalid, match="is not callable"):
        mods.load_object("cachekeeper.mods:__all__", field="f")
    with pytest.raises(WorkloadInvalid, match=r"f: calling 'cachekeeper.mods:causal' with"):
        mods.build_mask_mod("cachekeeper.mods:causal", {"x": 1}, field="f")
