"""The cost of what keeps programs that are not SPMD correct, beside the SPMD program, at W=2.

- The step check (on by default): shardkit's model with the check paired with itself without
  it (``benchmarks/paired.py``: alternating rounds, the median of per-round ratios), on
  ``linear8`` (8 x Linear(128, 128), each its own group: little compute per collective) and
  the 8M GPT (``small``). The check adds one exchange of a few dozen bytes per step.

Nothing is asserted on time: the machine is noisy. See docs/guide/not-spmd.md for the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from benchmarks import paired

WORLD = 2
SCENARIOS = {"linear8-w2": ("linear8", 150), "gpt8m-w2": ("small", 16)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_step_check_cost(benchmark: Any, scenario: str) -> None:
    size, rounds = SCENARIOS[scenario]

    def run_rounds(one_round: Callable[[], None], count: int) -> None:
        benchmark.pedantic(one_round, rounds=count, iterations=1, warmup_rounds=1)

    m = paired.measure(
        run_rounds,
        world=WORLD,
        size=size,
        impl="shardkit",
        peer="shardkit" + paired.NO_STEP_CHECK_SUFFIX,
        rounds=rounds,
    )
    assert m.ratio is not None and m.peer_step_s is not None
    benchmark.extra_info.update(
        {
            "scenario": scenario,
            "method": "paired",
            "median_step_s_checked": m.step_s,
            "median_step_s_unchecked": m.peer_step_s,
            "ratio_checked_vs_unchecked": m.ratio,
        }
    )
    print(
        f"\nstep check, {scenario}: {1e3 * m.step_s:.2f} ms vs {1e3 * m.peer_step_s:.2f} ms "
        f"a step, {m.ratio:.3f}"
    )
