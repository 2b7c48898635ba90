"""Durations with units (cachekeeper/units.py)."""

from __future__ import annotations

import pytest

from cachekeeper.units import parse_duration


def test_durations_with_and_without_units() -> None:
    assert parse_duration(90) == 90.0 and parse_duration(2.5) == 2.5
    assert parse_duration("90s") == 90.0 and parse_duration("90") == 90.0
    assert parse_duration("30m") == 1800.0 and parse_duration("30 min") == 1800.0
    assert parse_duration("1.5h") == 5400.0 and parse_duration("2d") == 172800.0
    assert parse_duration(" 10 Minutes ") == 600.0


@pytest.mark.parametrize("bad", ["", "soon", "5 weeks", "-3s", "0", 0, -1, True, "1e9", "inf"])
def test_bad_durations_name_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)
