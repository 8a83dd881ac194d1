"""Units every room shares: how bytes are written for people, and the default bandwidth.

One formatter keeps the planner's tables, the terminal summary and the plots in agreement: the
same number of bytes reads the same everywhere.
"""

from __future__ import annotations

__all__ = ["BYTE_UNITS", "DEFAULT_BANDWIDTH_GBPS", "MIB", "format_bytes"]

MIB = 1024 * 1024
"""Bytes in a mebibyte."""

BYTE_UNITS: tuple[tuple[str, float], ...] = (
    ("B", 1.0),
    ("KiB", 1024.0),
    ("MiB", 1024.0**2),
    ("GiB", 1024.0**3),
    ("TiB", 1024.0**4),
)
"""Binary units, smallest first, with their size in bytes."""

DEFAULT_BANDWIDTH_GBPS = 100.0
"""Per-rank bandwidth in GB/s (1e9 bytes per second) when none is given: the planner's figure
for communication time, a round number of the order of one InfiniBand NDR or 4x100G port."""


def format_bytes(n: float) -> str:
    """Bytes in binary units, three significant digits or so: ``1536`` → ``'1.50 KiB'``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit, _ in BYTE_UNITS[1:]:
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"
