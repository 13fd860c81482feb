"""Byte counts as people write them: ``80GB``, ``512MiB``, ``1.5e9``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """A memory size in bytes: an int, or a number with a unit (decimal ``GB``, binary ``GiB``).

    >>> parse_bytes("80GB"), parse_bytes("1.5 GiB"), parse_bytes(4096)
    (80000000000, 1610612736, 4096)
    """
    if isinstance(value, bool):
        raise TypeError(f"memory {value!r}: give bytes as an int or a string such as '80GB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory {value}: a budget is a positive number of bytes")
        return value
    if not isinstance(value, str):
        raise TypeError(f"memory {value!r}: give bytes as an int or a string such as '80GB'")
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise ValueError(f"memory {value!r}: write a number and a unit, e.g. '80GB' or '512MiB' "
                         f"(units: {', '.join(u for u in _UNITS if u)})")
    size = int(float(found.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory {value!r}: a budget is a positive number of bytes")
    return size


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(t: float) -> str:
    """``0.0123`` -> ``'12.30 ms'``: seconds in the unit that keeps three figures or so."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale or unit == "us":
            return f"{t / scale:.2f} {unit}"
    raise AssertionError("unreachable")
