"""The cost of desync checks (``SHARDKIT_DEBUG``) on a training step of the 8M GPT at W=2.

Two shardkit models are built side by side in the same persistent workers; the checks are
switched on (``set_debug``) for one only. Every round runs one step of each, alternating
which goes first, so drift in the machine's load hits both; a step's time is that of its
slowest rank, and the ratio recorded is the median of the per-round ratios (checked / plain).
The target is at most 1.10.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import gpt
from harness.pool import run_on_ranks

WORLD = 2
ROUNDS = 12
_STATE: dict[str, Any] = {}


def _setup(rank: int, world_size: int) -> None:
    _STATE.clear()
    for name in ("plain", "checked"):
        _STATE[name] = gpt.build("shardkit", "small", world_size)
        for step in range(2):  # warm-up: lazy init, allocator, the optimizer's first state
            _step(rank, world_size, name, step)


def _step(rank: int, world_size: int, name: str, step: int) -> dict[str, float]:
    from shardkit.core import set_debug

    model, opt = _STATE[name]
    set_debug(name == "checked")
    try:
        return gpt.train_step(model, opt, gpt.batch("small", step, rank, world_size))
    finally:
        set_debug(False)


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


def test_desync_check_cost(benchmark: Any) -> None:
    run_on_ranks(WORLD, _setup)
    times: dict[str, list[float]] = {"plain": [], "checked": []}
    counter = [10]

    def one_round() -> None:
        counter[0] += 1
        order = ("plain", "checked") if counter[0] % 2 else ("checked", "plain")
        for name in order:
            ranks = run_on_ranks(WORLD, _step, name=name, step=counter[0])
            times[name].append(max(r["seconds"] for r in ranks))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    run_on_ranks(WORLD, _teardown)
    ratio = statistics.median(c / p for c, p in zip(times["checked"], times["plain"], strict=True))
    benchmark.extra_info.update(
        {
            "scenario": "gpt8m-w2",
            "method": "paired",
            "median_step_s_plain": statistics.median(times["plain"]),
            "median_step_s_checked": statistics.median(times["checked"]),
            "ratio_checked_vs_plain": ratio,
        }
    )
    plain, checked = (1e3 * statistics.median(times[k]) for k in ("plain", "checked"))
    print(f"\ndesync checks, 8M GPT, W=2: {checked:.0f} ms vs {plain:.0f} ms a step, {ratio:.3f}")
