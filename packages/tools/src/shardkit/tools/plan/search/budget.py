"""A memory budget as people write it: ``80GiB``, ``75GB``, ``141e9``, ``512MiB``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
1000: the unit is the user's to choose, and the two differ by 7% at GiB. A bare number is
bytes.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
"""A lone letter (``80G``) is binary, as ``torch.cuda`` and ``nvidia-smi`` report memory."""

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_budget(text: str) -> int:
    """Bytes of a budget written as a number and an optional unit.

    Raises:
        ValueError: naming the text, when it is not a positive number with a known unit.
    """
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"budget {text!r} is not a number with a unit (80GiB, 75GB, 141e9)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ValueError(f"budget {text!r}: unknown unit {match.group(2)!r} (one of {known})")
    value = number * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"budget {text!r} must be at least one byte")
    return int(value)


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB above 1 GiB, else MiB, two decimals."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB"
