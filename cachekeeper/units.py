"""Durations with units, as workload files and options write them.

``parse_duration("90s") == 90.0``, ``"30m"`` is 1800, ``"1.5h"`` 5400, ``"2d"`` 172800, and a
plain number (int, float, or its text) is seconds. Sizes with units are
``cachekeeper.server.settings.parse_size``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["parse_duration"]

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*)$")
_DURATION_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}


def parse_duration(value: Any) -> float:
    """Seconds (> 0) from a number or a text with a unit (``s``, ``m``, ``h``, ``d``).

    Raises ValueError naming the value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        found = _DURATION_RE.match(str(value).strip().lower().replace("_", ""))
        if found is None or found.group(2) not in _DURATION_UNITS:
            raise ValueError(
                f"{value!r} is not a duration: give seconds, or a number with a unit"
                " (90s, 30m, 1.5h, 2d)"
            )
        seconds = float(found.group(1)) * _DURATION_UNITS[found.group(2)]
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{value!r} is not a positive duration")
    return seconds
