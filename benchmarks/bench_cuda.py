"""The training-step benchmark on CUDA: NCCL, one process per GPU, skipped without CUDA.

Launches ``benchmarks/cuda_run.py`` under torchrun on every visible GPU and records shardkit's
step time and peak allocated memory against torch's fully_shard from the same run.
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


@pytest.mark.parametrize("size", ["small", "medium"])
def test_cuda_train_step(benchmark: Any, size: str) -> None:
    gpus = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={gpus}"]
    cmd += [str(ROOT / "benchmarks" / "cuda_run.py"), size, "20"]
    found: dict[str, Any] = {}

    def run() -> None:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
        found.update(json.loads(next(x for x in out.stdout.splitlines() if x[:1] == "{")))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        subject="shardkit",
        world=found["world"],
        median_step_s=found["shardkit_s"],
        peer_median_step_s=found["torch_s"],
        ratio_vs_peer=found["ratio"],
        peak_alloc_mib=found["peak_alloc_mib"],
        peak_alloc_ratio_vs_peer=found["peak_alloc_mib"]["shardkit"]
        / found["peak_alloc_mib"]["torch"],
    )
