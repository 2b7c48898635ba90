"""The device grammar (cpu | cuda | cuda:0,1) shared by prewarm, verify, agent, pull, prejob."""

from __future__ import annotations

import pytest

from cachekeeper.environment.devices import (
    coverage_advice,
    format_devices,
    parse_devices,
    requested_devices,
)
from cachekeeper.errors import DeviceInvalid, PrewarmFailed


def test_parse_devices() -> None:
    assert parse_devices("cpu", visible=[]) == ["cpu"]
    assert parse_devices("cuda", visible=[0, 1, 2]) == ["cuda:0", "cuda:1", "cuda:2"]
    assert parse_devices("cuda:0,2", visible=[0, 1, 2]) == ["cuda:0", "cuda:2"]
    assert parse_devices("cuda:1", visible=[0, 1]) == ["cuda:1"]
    with pytest.raises(DeviceInvalid, match="no GPU is visible"):
        parse_devices("cuda", visible=[])
    assert parse_devices("cuda:5-7", visible=list(range(8))) == ["cuda:5", "cuda:6", "cuda:7"]
    assert parse_devices("cuda:1,0-2", visible=[0, 1, 2]) == ["cuda:1", "cuda:0", "cuda:2"]
    with pytest.raises(DeviceInvalid, match=r"cuda:3 is not visible \(visible: cuda:0,1\)"):
        parse_devices("cuda:0,3", visible=[0, 1])
    with pytest.raises(DeviceInvalid, match="'x' is not a GPU index"):
        parse_devices("cuda:0,x", visible=[0])
    with pytest.raises(DeviceInvalid, match="expected 'cpu', 'cuda'"):
        parse_devices("tpu", visible=[0])


def test_requested_devices_parses_without_asking_for_gpus() -> None:
    assert requested_devices(None) is None
    assert requested_devices("cuda") is None  # every visible GPU, as with no option
    assert requested_devices("cpu") == ["cpu"]
    assert requested_devices("cuda:0,1") == ["cuda:0", "cuda:1"]
    assert requested_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    with pytest.raises(DeviceInvalid, match="expected 'cpu', 'cuda'"):
        requested_devices("tpu")
    with pytest.raises(DeviceInvalid, match="'x' is not a GPU index"):
        requested_devices("cuda:0,x")


def test_a_builder_with_fewer_gpus_refuses_the_higher_indices_and_says_what_to_do() -> None:
    # the GPUs are injected (this machine has none): a 2-GPU builder asked for 8 indices
    with pytest.raises(DeviceInvalid) as caught:
        parse_devices("cuda:0-7", visible=[0, 1])
    message = caught.value.detail
    assert message.startswith("device cuda:2-7 is not visible (visible: cuda:0,1)")
    assert ">= 8 GPUs" in message and "one visible GPU per rank" in message


def test_ranges_and_their_bound() -> None:
    eight = [f"cuda:{i}" for i in range(8)]
    assert requested_devices("cuda:0-7") == eight
    assert requested_devices("cuda:5,6,cuda:7,5") == ["cuda:5", "cuda:6", "cuda:7"]
    with pytest.raises(DeviceInvalid, match="'2-x' is not a GPU index or range"):
        requested_devices("cuda:0,2-x")
    with pytest.raises(DeviceInvalid, match="past cuda:1023"):
        requested_devices("cuda:0-99999999")


def test_format_devices() -> None:
    assert format_devices([f"cuda:{i}" for i in range(8)]) == "cuda:0-7"
    assert format_devices(["cuda:1", "cuda:0"]) == "cuda:0,1"
    assert format_devices(["cuda:0", "cuda:5", "cuda:6", "cuda:7"]) == "cuda:0,5-7"
    assert format_devices(["cpu"]) == "cpu" and format_devices([]) == "none"


def test_coverage_advice_names_the_unbuilt_indices_and_the_two_ways_out() -> None:
    eight = [f"cuda:{i}" for i in range(8)]
    assert coverage_advice(covered=["cuda:0", "cuda:1"], wanted=eight) == (
        "snapshot covers cuda:0,1; this node asks for cuda:0-7: cuda:2-7 never built (the"
        " device index is in Inductor's key): build cuda:2-7 on a builder with >= 8 GPUs"
        " (prewarm --device cuda:2-7), or run one visible GPU per rank (then only cuda:0 is"
        " needed)"
    )
    # a snapshot without cuda:0 cannot serve one-GPU-per-rank jobs: that way out is not offered
    only_drafter = coverage_advice(covered=["cuda:5", "cuda:6", "cuda:7"], wanted=["cuda:0"])
    assert only_drafter.endswith(
        "build cuda:0 on a builder with >= 1 GPU (prewarm --device cuda:0)"
    )


def test_a_bad_device_is_a_device_error_not_a_failed_prewarm() -> None:
    """Issue 26: a typo in --device raised PrewarmFailed (code prewarm_failed), as if a
    build had failed; it is a DeviceInvalid, with the same usage exit code."""
    with pytest.raises(DeviceInvalid) as caught:
        requested_devices("gpu:0")
    assert not isinstance(caught.value, PrewarmFailed)
    assert (caught.value.code, caught.value.exit_code) == ("invalid_device", 2)
