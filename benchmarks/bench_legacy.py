"""shardkit.legacy against torch's FSDP1: the FSDP1 script's training step and peak RSS.

The workload is demo/train_fsdp1.py's step (transformer auto-wrap, bf16 mixed precision,
clipping, AdamW) on a 6.4M-parameter GPT at W=2 (and the same model with NO_SHARD in fp32),
built by each implementation side by side in the same pool workers. Rounds are paired as in
``bench_train_step.py``: each runs one step of each, alternating which goes first, and the
ratio is the median of per-round ratios. Peak RSS comes from one torchrun launch per
implementation with MALLOC_MMAP_THRESHOLD_=65536. The target (issue 14) is at most 0.85 of
FSDP1's step time; nothing is asserted on time (the machine is shared and noisy). The ratio
sits within a few hundredths of the target, so the rounds are many (96) and the printed
interval (a bootstrap of the median, 95%) says whether a run can tell the two apart.
``LEGACY_ROUNDS`` sets the number of rounds.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import legacy_workload
from harness.pool import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("torch", "shardkit")  # the peer first
# 96 by default; LEGACY_ROUNDS=12 where a step is slow (the script's bf16 step is emulated,
# 15 s, on a CPU without native bf16: 96 rounds would take an hour).
ROUNDS = int(os.environ.get("LEGACY_ROUNDS", "96"))
_STATE: dict[str, Any] = {}


def _setup(rank: int, world_size: int, scenario: str) -> None:
    _STATE.clear()
    _STATE["scenario"] = scenario
    for impl in IMPLS:
        model, opt = legacy_workload.setup(impl, rank, scenario)
        _STATE[impl] = (model, opt)
        for step in range(2):  # warm-up: lazy init, allocator, the optimizer's first state
            _step(rank, world_size, impl, step)


def _step(rank: int, world_size: int, impl: str, step: int) -> float:
    model, opt = _STATE[impl]
    scenario = _STATE["scenario"]
    data = legacy_workload.batch(step, rank, world_size, scenario)
    return legacy_workload.timed_step(model, opt, data, scenario)


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


@pytest.mark.parametrize("scenario", ["script", "no_shard", "mnist"])
def test_fsdp1_step(benchmark: Any, scenario: str) -> None:
    # bf16 emulated on a CPU without it: 15 s a step, four warm-up steps in the setup.
    run_on_ranks(2, _setup, scenario=scenario, timeout_s=900)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    counter = [10]

    def one_round() -> None:
        counter[0] += 1
        order = IMPLS if counter[0] % 2 else IMPLS[::-1]
        for impl in order:
            times[impl].append(
                max(run_on_ranks(2, _step, impl=impl, step=counter[0], timeout_s=600))
            )

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    run_on_ranks(2, _teardown)
    ratios = [ours / theirs for ours, theirs in zip(times["shardkit"], times["torch"], strict=True)]
    info: dict[str, Any] = {
        f"median_step_s_{impl}": statistics.median(t) for impl, t in times.items()
    }
    info["ratio_vs_fsdp1"] = statistics.median(ratios)
    info["ratio_95_interval"] = _median_interval(ratios)
    info["subject"] = "shardkit"  # the ratio is ours against the peer: bench-compare guards it
    info["method"] = f"paired{ROUNDS}"
    info["scenario"] = scenario
    benchmark.extra_info.update(info)
    targets = {"script": " (target ratio <= 0.85)", "mnist": " (target ratio <= 1.00)"}
    target = targets.get(scenario, "")
    sys.stdout.write(f"\nFSDP1 {scenario} step: {info}{target}\n")


def _median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (seeded: the same values, the same
    interval)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _peak_rss(impl: str) -> list[float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "benchmarks" / "legacy_memory_run.py"), impl, "4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    records = [json.loads(x) for x in out.stdout.splitlines() if x[:1] == "{"]
    return [float(r["peak_mib"]) for r in sorted(records, key=lambda r: int(r["rank"]))]


def test_fsdp1_script_peak_rss(benchmark: Any) -> None:
    peaks: dict[str, list[float]] = {}

    def measure() -> None:
        for impl in IMPLS:
            peaks[impl] = _peak_rss(impl)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    for impl, ranks in peaks.items():
        benchmark.extra_info[f"peak_rss_mib_{impl}_per_rank"] = ranks
    ratio = max(peaks["shardkit"]) / max(peaks["torch"])
    benchmark.extra_info["peak_rss_ratio_vs_fsdp1"] = ratio
    sys.stdout.write(f"\nFSDP1 script peak RSS (MiB per rank): {peaks}, ratio {ratio:.3f}\n")
