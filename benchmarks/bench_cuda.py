"""The training-step benchmark on CUDA: NCCL, one process per GPU, skipped without CUDA.

Launches ``benchmarks/cuda_run.py`` under torchrun on every visible GPU, once per engine (each
measured in its own processes), and records shardkit's step time and peak allocated memory
against torch's fully_shard. At one GPU shardkit runs no collective (its one-rank path): see
``cuda_run.py``; scripts/check_gpu.py adds W>1 points on the fake process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(impl: str, size: str) -> dict[str, Any]:
    gpus = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={gpus}"]
    cmd += [str(ROOT / "benchmarks" / "cuda_run.py"), size, "20", impl]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    found: dict[str, Any] = json.loads(next(x for x in out.stdout.splitlines() if x[:1] == "{"))
    return found


@pytest.mark.parametrize("size", ["small", "medium"])
def test_cuda_train_step(benchmark: Any, size: str) -> None:
    found: dict[str, dict[str, Any]] = {}

    def run() -> None:
        for impl in ("torch", "shardkit"):
            found[impl] = _run(impl, size)

    benchmark.pedantic(run, rounds=1, iterations=1)
    ours, theirs = found["shardkit"], found["torch"]
    benchmark.extra_info.update(
        subject="shardkit",
        world=ours["world"],
        median_step_s=ours["step_s"],
        peer_median_step_s=theirs["step_s"],
        ratio_vs_peer=ours["step_s"] / theirs["step_s"],
        peak_alloc_mib={"shardkit": ours["peak_alloc_mib"], "torch": theirs["peak_alloc_mib"]},
        peak_alloc_ratio_vs_peer=ours["peak_alloc_mib"] / theirs["peak_alloc_mib"],
    )
