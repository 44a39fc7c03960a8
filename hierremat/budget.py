"""Memory budgets: parsing "512MiB"-style strings and printing byte counts."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

#: A bare integer below this is taken for a segment count, not a byte budget.
MIN_BARE_INT_BUDGET = 2**20


def parse_budget(budget: int | float | str, *, name: str = "budget") -> int:
    """Return a memory budget in bytes.

    Accepts an int (bytes, at least 1 MiB) or a string with a unit: "512MiB", "1.5GiB",
    "3GB", "2e9" (bytes). Binary units (KiB, MiB, GiB) are powers of 1024, decimal
    ones (KB, MB, GB) powers of 1000; bare K/M/G are binary.
    """
    if isinstance(budget, bool):
        raise TypeError(f"{name} must be bytes (int) or a string like '512MiB', not a bool")
    if isinstance(budget, (int, float)) and not isinstance(budget, str):
        if budget != budget or budget in (float("inf"), float("-inf")):
            raise ValueError(f"{name}={budget!r} is not a finite number of bytes")
        if budget < MIN_BARE_INT_BUDGET:
            raise ValueError(
                f"{name}={budget!r} looks like a segment count, not a memory budget: hierremat takes "
                f"a budget in bytes (at least 1 MiB as a bare number) or a string such as '512MiB'."
            )
        return int(budget)
    if not isinstance(budget, str):
        raise TypeError(f"{name} must be bytes (int) or a string like '512MiB', got {type(budget).__name__}")
    match = _PATTERN.match(budget)
    if not match or match.group(2).lower() not in _UNITS | {"": 1}:
        raise ValueError(
            f"{name}={budget!r} is not a memory size; write e.g. '512MiB', '1.5GiB', '3GB' or a byte count"
        )
    value = float(match.group(1)) * _UNITS.get(match.group(2).lower(), 1)
    if not match.group(2):
        return parse_budget(value, name=name)
    if value < 1:
        raise ValueError(f"{name}={budget!r} is below one byte")
    return int(value)


def format_bytes(n: int | float) -> str:
    """Human-readable byte count with binary units, e.g. 1536 -> '1.50 KiB'."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
