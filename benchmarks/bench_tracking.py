"""What tracking costs: the 8M GPT's step at W=2 (shardkit) untracked, and under each tracker.

Paired rounds: every round runs one untracked step and one tracked step, alternating which
goes first; the overhead recorded is the median of the per-round ratios minus one. Targets:
under 10% with CommTracker, under 25% with MemoryTracker.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from benchmarks import gpt
from harness.pool import run_on_ranks
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.memory import MemoryTracker
from shardkit.tools.track.profiler import Profiler

_STATE: dict[str, Any] = {}
TRACKERS = ("comm", "memory", "both")


def _setup(rank: int, world_size: int) -> None:
    _STATE.clear()
    model, opt = gpt.build("shardkit", "small", world_size)
    for step in range(2):
        gpt.train_step(model, opt, gpt.batch("small", step, rank, world_size))
    _STATE.update(model=model, opt=opt)


def _step(rank: int, world_size: int, step: int, tracker: str) -> float:
    model, opt = _STATE["model"], _STATE["opt"]
    data = gpt.batch("small", step, rank, world_size)
    if tracker == "none":
        return gpt.train_step(model, opt, data)["seconds"]
    made: CommTracker | MemoryTracker | Profiler
    if tracker == "comm":
        made = CommTracker()
    elif tracker == "memory":
        made = MemoryTracker(model, optimizers=[opt])
    else:
        made = Profiler(model, optimizers=[opt])
    with made:
        return gpt.train_step(model, opt, data)["seconds"]


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


@pytest.mark.parametrize("tracker", TRACKERS)
def test_tracking_overhead(benchmark: Any, tracker: str) -> None:
    run_on_ranks(2, _setup)
    times: dict[str, list[float]] = {"none": [], tracker: []}
    counter = [10]

    def one_round() -> None:
        counter[0] += 1
        order = ("none", tracker) if counter[0] % 2 else (tracker, "none")
        for which in order:
            times[which].append(max(run_on_ranks(2, _step, step=counter[0], tracker=which)))

    benchmark.pedantic(one_round, rounds=20, iterations=1, warmup_rounds=1)
    run_on_ranks(2, _teardown)
    ratio = statistics.median(t / b for t, b in zip(times[tracker], times["none"], strict=True))
    benchmark.extra_info.update(
        subject="shardkit",
        tracker=tracker,
        untracked_median_s=statistics.median(times["none"]),
        tracked_median_s=statistics.median(times[tracker]),
        overhead=ratio - 1,
    )
