"""Training step at W=2: shardkit vs torch's fully_shard vs DDP, in one run.

Time: each round is one training step on a persistent 2-rank worker pool (the slowest rank's
step time, so process start-up is never timed). Bytes: written to gloo's sockets per rank per
step, against the theoretical minimum 3 * 4 bytes * params * (W-1)/W (fp32, AG+AG+RS).
Memory: peak RSS per rank, each implementation in its own torchrun launch with
MALLOC_MMAP_THRESHOLD_=65536 so glibc's retention does not hide live memory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.harness.pool import run_on_ranks

from benchmarks import gpt

WORLD = 2
SIZE = os.environ.get("SHARDKIT_BENCH_SIZE", "small")
IMPLS = ["torch", "shardkit", "ddp"]
ROOT = Path(__file__).resolve().parents[1]
_STATE: dict[str, tuple[Any, Any]] = {}
_RESULTS: dict[str, dict[str, float]] = {}
_step_counter = [0]


def _setup(rank: int, world_size: int, impl: str, size: str) -> None:
    _STATE.clear()
    _STATE[impl] = gpt.build(impl, size, world_size)
    for step in range(2):  # warm-up: lazy init, allocator, first optimizer state
        model, opt = _STATE[impl]
        gpt.train_step(model, opt, gpt.batch(size, step, rank, world_size))


def _step(rank: int, world_size: int, impl: str, size: str, step: int) -> dict[str, float]:
    model, opt = _STATE[impl]
    return gpt.train_step(model, opt, gpt.batch(size, step, rank, world_size))


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


@pytest.mark.parametrize("impl", IMPLS)
def test_train_step(benchmark: Any, impl: str) -> None:
    run_on_ranks(WORLD, _setup, impl=impl, size=SIZE)
    records: list[dict[str, float]] = []

    def one_step() -> None:
        _step_counter[0] += 1
        records.extend(run_on_ranks(WORLD, _step, impl=impl, size=SIZE, step=_step_counter[0]))

    benchmark.pedantic(one_step, rounds=15, iterations=1, warmup_rounds=1)
    run_on_ranks(WORLD, _teardown)
    per_step = [
        max(a["seconds"], b["seconds"]) for a, b in zip(records[::2], records[1::2], strict=True)
    ]
    wire = statistics.median(r["wire_bytes"] for r in records)
    theory = 3 * 4 * gpt.param_count(SIZE) * (WORLD - 1) / WORLD
    _RESULTS[impl] = {"step_s": statistics.median(per_step), "wire_over_min": wire / theory}
    benchmark.extra_info.update(
        size=SIZE,
        params=gpt.param_count(SIZE),
        median_step_s=_RESULTS[impl]["step_s"],
        wire_bytes_per_rank=wire,
        wire_over_theoretical_min=wire / theory,
    )
    if "torch" in _RESULTS:
        benchmark.extra_info["step_ratio_vs_torch"] = (
            _RESULTS[impl]["step_s"] / _RESULTS["torch"]["step_s"]
        )


def _peak_rss(impl: str) -> list[dict[str, float]]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
    ]
    cmd += [str(ROOT / "benchmarks" / "memory_run.py"), impl, SIZE, "4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_peak_rss(benchmark: Any) -> None:
    peaks: dict[str, float] = {}

    def measure() -> None:
        for impl in IMPLS:
            peaks[impl] = max(r["peak_mib"] for r in _peak_rss(impl))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update({f"peak_rss_mib_{k}": v for k, v in peaks.items()})
    benchmark.extra_info["peak_rss_ratio_vs_torch"] = peaks["shardkit"] / peaks["torch"]
    _RESULTS["memory"] = {k: v for k, v in peaks.items()}


def test_summary() -> None:
    """Print the ratios (nothing is asserted on time: the machine is shared and noisy)."""
    if "torch" not in _RESULTS or "shardkit" not in _RESULTS:
        pytest.skip("run the whole module to get the summary")
    ours, theirs = _RESULTS["shardkit"], _RESULTS["torch"]
    lines = [
        f"step time shardkit/torch: {ours['step_s'] / theirs['step_s']:.3f}",
        f"wire bytes / theoretical min: shardkit {ours['wire_over_min']:.3f}, "
        f"torch {theirs['wire_over_min']:.3f}",
    ]
    if "ddp" in _RESULTS:
        lines.append(f"step time shardkit/ddp: {ours['step_s'] / _RESULTS['ddp']['step_s']:.3f}")
    if "memory" in _RESULTS:
        mem = _RESULTS["memory"]
        lines.append(f"peak RSS shardkit/torch: {mem['shardkit'] / mem['torch']:.3f}")
    out = ROOT / "benchmarks" / ".results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n" + "\n".join(lines) + "\n")
    # Bytes are deterministic: these are checked, not just reported.
    assert ours["wire_over_min"] == pytest.approx(1.0, abs=0.01)
