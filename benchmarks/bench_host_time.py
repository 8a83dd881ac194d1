"""A step's host time on torch's fake process group at W=8, 64 and 256: shardkit beside torch.

Issue 31 found shardkit's step launch-bound on an H100 at scale: on the fake group, the GPU
time of a 7.5B model's step was torch's, but the CPU time spent issuing it was 1.7 times
torch's at W=64, and grew with W. Counting operators (``bench_op_counts.py``) says how many
kernels a step launches; this says how long the host takes to issue them, Python hooks and
all, which is what a launch-bound GPU step waits for. It runs on a CPU: the model has the
7.5B model's 32 blocks at a width of 256 (``gpt.SIZES["host-32"]``, bf16 mixed precision,
activation checkpointing, meta-device init, as ``fake_scale.py``), so compute is a small part
of the step and the rest is each engine's own work on the host. Both engines' models live in
one process on one fake group; each round times one step of each, alternating which goes
first, and the ratio is the median of the per-round ratios (this machine is shared).

A CPU's dispatch of a tiny operator costs about what a CUDA launch costs the host, but not
the same: the figure is a proxy for the GPU's host time, not a GPU measurement. The GPU's own
step times come from ``make check-gpu`` (the scale chunks).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benchmarks import gpt
from benchmarks.fake_scale import OPTIONS
from benchmarks.op_count_workload import fake_world

SIZE = "host-32"
WORLDS = (8, 64, 256)
ENGINES = ("shardkit", "torch")
WARMUP = 2
ROUNDS = 15


def _step_s(model: Any, opt: Any, step: int) -> float:
    data = gpt.batch(SIZE, step, 0, 1)
    started = time.perf_counter()
    gpt.train_step(model, opt, data)
    return time.perf_counter() - started


def measure(world: int, rounds: int = ROUNDS) -> dict[str, float]:
    """Median step seconds of each engine and the median per-round ratio, at ``world``."""
    with fake_world(world):
        built = {engine: gpt.build(engine, SIZE, world, OPTIONS) for engine in ENGINES}
        for step in range(WARMUP):
            for model, opt in built.values():
                _step_s(model, opt, step)
        times: dict[str, list[float]] = {engine: [] for engine in ENGINES}
        for round_ in range(rounds):
            order = ENGINES if round_ % 2 == 0 else ENGINES[::-1]
            for engine in order:
                times[engine].append(_step_s(*built[engine], WARMUP + round_))
        del built
    ratios = [ours / theirs for ours, theirs in zip(times["shardkit"], times["torch"], strict=True)]
    return {
        "shardkit_s": statistics.median(times["shardkit"]),
        "torch_s": statistics.median(times["torch"]),
        "ratio": statistics.median(ratios),
    }


def test_host_time_per_step(benchmark: Any) -> None:
    table: dict[int, dict[str, float]] = {}

    def run() -> None:
        table.clear()
        for world in WORLDS:
            table[world] = measure(world)

    benchmark.pedantic(run, rounds=1, iterations=1)
    out = ["", f"host time of one step, fake group, {SIZE} (32 blocks of 256), bf16 + AC:"]
    out.append(f"{'W':>5}{'shardkit ms':>14}{'torch ms':>11}{'ratio':>8}")
    for world, row in table.items():
        out.append(
            f"{world:>5}{row['shardkit_s'] * 1e3:>14.1f}{row['torch_s'] * 1e3:>11.1f}"
            f"{row['ratio']:>8.2f}"
        )
        for key, value in row.items():
            benchmark.extra_info[f"W{world}_{key}"] = value
    # What `make bench-compare` guards: the worst world size's ratio.
    benchmark.extra_info["ratio_vs_peer"] = max(row["ratio"] for row in table.values())
    sys.stdout.write("\n".join(out) + "\n")
