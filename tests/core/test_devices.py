"""The device grammar (cpu | cuda | cuda:0,1) shared by prewarm, verify, agent, pull, prejob."""

from __future__ import annotations

import pytest

from cachekeeper.devices import parse_devices, requested_devices
from cachekeeper.errors import PrewarmFailed


def test_parse_devices() -> None:
    assert parse_devices("cpu", visible=[]) == ["cpu"]
    assert parse_devices("cuda", visible=[0, 1, 2]) == ["cuda:0", "cuda:1", "cuda:2"]
    assert parse_devices("cuda:0,2", visible=[0, 1, 2]) == ["cuda:0", "cuda:2"]
    assert parse_devices("cuda:1", visible=[0, 1]) == ["cuda:1"]
    with pytest.raises(PrewarmFailed, match="no GPU is visible"):
        parse_devices("cuda", visible=[])
    with pytest.raises(PrewarmFailed, match=r"cuda:3 is not visible \(visible: 0,1\)"):
        parse_devices("cuda:0,3", visible=[0, 1])
    with pytest.raises(PrewarmFailed, match="'x' is not a GPU index"):
        parse_devices("cuda:0,x", visible=[0])
    with pytest.raises(PrewarmFailed, match="expected 'cpu', 'cuda'"):
        parse_devices("tpu", visible=[0])


def test_requested_devices_parses_without_asking_for_gpus() -> None:
    assert requested_devices(None) is None
    assert requested_devices("cuda") is None  # every visible GPU, as with no option
    assert requested_devices("cpu") == ["cpu"]
    assert requested_devices("cuda:0,1") == ["cuda:0", "cuda:1"]
    assert requested_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    with pytest.raises(PrewarmFailed, match="expected 'cpu', 'cuda'"):
        requested_devices("tpu")
    with pytest.raises(PrewarmFailed, match="'x' is not a GPU index"):
        requested_devices("cuda:0,x")
