"""Full state dict to rank 0 at W=2: shardkit's streaming save vs torch's DSD path, one run.

Time is the median of 3 saves; memory is rank 0's peak RSS above its RSS at the start of a
save (the high-water mark is reset first), with MALLOC_MMAP_THRESHOLD_=65536 so that freed
memory shows. The model is the 'medium' GPT (33.7M parameters, 128 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import gpt

ROOT = Path(__file__).resolve().parents[1]
SIZE = os.environ.get("SHARDKIT_BENCH_FULL_SD_SIZE", "medium")


def _run(impl: str, out: Path, size: str = SIZE) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    nproc = 4 if size == "tp" else 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    cmd += [str(ROOT / "benchmarks" / "full_state_dict_run.py"), impl, size, str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=900)
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    result: dict[str, Any] = json.loads(line)
    return result


def test_full_state_dict_to_rank0(benchmark: Any, tmp_path: Path) -> None:
    results: dict[str, dict[str, Any]] = {}

    def measure() -> None:
        for impl in ("torch", "shardkit"):
            results[impl] = _run(impl, tmp_path)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    ours, theirs = results["shardkit"], results["torch"]
    largest_group_mib = 4 * gpt.largest_group_params(SIZE) / 2**20
    benchmark.extra_info.update(
        params=gpt.param_count(SIZE),
        seconds_shardkit=ours["seconds"],
        seconds_torch=theirs["seconds"],
        time_ratio_vs_torch=ours["seconds"] / theirs["seconds"],
        peak_above_start_mib_shardkit=ours["peak_above_start_mib"],
        peak_above_start_mib_torch=theirs["peak_above_start_mib"],
        memory_bound_mib=ours["model_mib"] + largest_group_mib,
    )
    sys.stdout.write(
        f"\nfull state dict: time shardkit/torch {ours['seconds'] / theirs['seconds']:.3f}; "
        f"rank-0 peak above start: shardkit {ours['peak_above_start_mib']:.0f} MiB, "
        f"torch {theirs['peak_above_start_mib']:.0f} MiB, "
        f"bound (model + largest group) {ours['model_mib'] + largest_group_mib:.0f} MiB\n"
    )
    # Memory is deterministic enough to check: the streaming save stays under the bound.
    assert ours["peak_above_start_mib"] <= ours["model_mib"] + largest_group_mib


def test_full_state_dict_to_rank0_2d(benchmark: Any, tmp_path: Path) -> None:
    """The same at dp 2 x tp 2 (the FSDP x TP workload): the 1D bound holds under TP."""
    results: dict[str, dict[str, Any]] = {}

    def measure() -> None:
        for impl in ("torch", "shardkit"):
            results[impl] = _run(impl, tmp_path, size="tp")

    benchmark.pedantic(measure, rounds=1, iterations=1)
    ours, theirs = results["shardkit"], results["torch"]
    bound = ours["model_mib"] + ours["largest_group_mib"]
    benchmark.extra_info.update(
        time_ratio_vs_torch=ours["seconds"] / theirs["seconds"],
        peak_above_start_mib_shardkit=ours["peak_above_start_mib"],
        peak_above_start_mib_torch=theirs["peak_above_start_mib"],
        memory_bound_mib=bound,
    )
    sys.stdout.write(
        f"\nfull state dict, dp 2 x tp 2: time shardkit/torch "
        f"{ours['seconds'] / theirs['seconds']:.3f}; rank-0 peak above start: shardkit "
        f"{ours['peak_above_start_mib']:.0f} MiB, torch {theirs['peak_above_start_mib']:.0f} "
        f"MiB, bound (model + largest group) {bound:.0f} MiB\n"
    )
    assert ours["peak_above_start_mib"] <= bound
