"""The cost of desync checks (``SHARDKIT_DEBUG``) and lifetime checks on a training step, at W=2.

Two shardkit models are built side by side in the same persistent workers, and the checks are
switched on (``set_debug``) for the steps of one only (``benchmarks/paired.py``): every round
runs one step of each, alternating which goes first, so drift in the machine's load hits
both; a step's time is that of its slowest rank, and the ratio recorded is the median of the
per-round ratios (checked / plain).

Scenarios: ``linear8`` (8 x Linear(128, 128), each its own group: little compute per
collective, where a per-collective cost shows most; target at most 1.25) and the 8M GPT
(``small``; target at most 1.10). The lifetime checks (``SHARDKIT_DEBUG_LIFETIMES``, on in
the test suite) are measured the same way on the same scenarios. Nothing is asserted on time:
the machine is noisy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from benchmarks import paired

WORLD = 2
# The small model's step is a few milliseconds: many rounds for a stable median.
SCENARIOS = {"linear8-w2": ("linear8", 150), "gpt8m-w2": ("small", 16)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_desync_check_cost(benchmark: Any, scenario: str) -> None:
    _measure(benchmark, scenario, paired.DEBUG_SUFFIX, "desync checks")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lifetime_check_cost(benchmark: Any, scenario: str) -> None:
    _measure(benchmark, scenario, paired.LIFETIMES_SUFFIX, "lifetime checks")


def _measure(benchmark: Any, scenario: str, suffix: str, what: str) -> None:
    """The model with the checks of ``suffix`` on for its steps, paired with it plain."""
    size, rounds = SCENARIOS[scenario]

    def run_rounds(one_round: Callable[[], None], count: int) -> None:
        benchmark.pedantic(one_round, rounds=count, iterations=1, warmup_rounds=1)

    m = paired.measure(
        run_rounds, world=WORLD, size=size, impl="shardkit" + suffix, peer="shardkit", rounds=rounds
    )
    assert m.ratio is not None and m.peer_step_s is not None
    benchmark.extra_info.update(
        {
            "scenario": scenario,
            "method": "paired",
            "median_step_s_plain": m.peer_step_s,
            "median_step_s_checked": m.step_s,
            "ratio_checked_vs_plain": m.ratio,
        }
    )
    print(
        f"\n{what}, {scenario}: {1e3 * m.step_s:.1f} ms vs {1e3 * m.peer_step_s:.1f} ms a step, "
        f"{m.ratio:.3f}"
    )
