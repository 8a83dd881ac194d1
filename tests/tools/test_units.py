"""Units shared by the rooms: one byte formatter, one default bandwidth."""

from __future__ import annotations

import pytest

from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS, MIB, format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (3 * MIB, "3.00 MiB"),
        (1.5 * 1024 * MIB, "1.50 GiB"),
        (5 * 1024 * MIB + 512 * MIB, "5.50 GiB"),
        (3 * 1024**5, "3072.00 TiB"),
    ],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_one_default_bandwidth() -> None:
    assert PlanOptions().bandwidth_gbps == DEFAULT_BANDWIDTH_GBPS
