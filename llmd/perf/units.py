"""Quantities as profile files write them ("3.35 TB/s", "81559 MiB", "20 us", "989e12"), read into SI floats.

The number is read as a decimal and scaled exactly before the one rounding to float, so "3.35 TB/s" is the very float
the literal 3.35e12 is.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

# Decimal prefixes, as datasheets use them for FLOP/s, bandwidths and "GB" of memory.
_SI = {prefix: Decimal(10) ** (3 * power) for power, prefix in enumerate(("", "K", "M", "G", "T", "P"))}
_BINARY = {"KiB": Decimal(2) ** 10, "MiB": Decimal(2) ** 20, "GiB": Decimal(2) ** 30, "TiB": Decimal(2) ** 40}

# The units each dimension accepts, with their size in the SI unit (FLOP/s, bytes, bytes/s, seconds).
UNITS: dict[str, dict[str, Decimal]] = {
    "FLOP/s": {f"{prefix}FLOP/s": scale for prefix, scale in _SI.items()},
    "B": {**{f"{prefix}B": scale for prefix, scale in _SI.items()}, **_BINARY},
    # NICs are quoted in bits per second (a "400 Gb/s" NDR port moves 50 GB/s).
    "B/s": {
        **{f"{prefix}B/s": scale for prefix, scale in _SI.items()},
        **{f"{prefix}b/s": scale / 8 for prefix, scale in _SI.items()},
    },
    "s": {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"), "ns": Decimal("1e-9")},
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][-+]?\d+)?)\s*(\S*)\s*$")


def parse_quantity(value: object, dimension: str | None) -> float:
    """`value` (a number, or a string "<number> [unit]") in the SI unit of `dimension` (None: a plain number).

    Raises ValueError with a message that says which units `dimension` takes.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number{_unit_hint(dimension)}, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        match = _QUANTITY.match(value)
        if match is None:
            raise ValueError(f"expected a number{_unit_hint(dimension)}, got {value!r}")
        digits, unit = match.group(1).replace("_", ""), match.group(2)
        scale = Decimal(1)
        if unit:
            units = UNITS.get(dimension or "", {})
            if unit not in units:
                raise ValueError(f"unknown unit {unit!r} in {value!r}; expected a number{_unit_hint(dimension)}")
            scale = units[unit]
        try:
            number = float(Decimal(digits) * scale)
        except InvalidOperation:
            raise ValueError(f"expected a number{_unit_hint(dimension)}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _unit_hint(dimension: str | None) -> str:
    if dimension is None:
        return " (no unit)"
    return f" in {dimension} or with a unit ({', '.join(UNITS[dimension])})"
