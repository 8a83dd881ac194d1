"""The CUDA path (NCCL, one process per GPU): parity with torch's fully_shard, CPU offload.

Skipped where CUDA is absent (CI and the CPU development machines); ``make check-gpu`` runs
these scripts too, and prints their figures (scripts/check_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.interop import cuda_offload_race, cuda_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HERE = Path(__file__).parent


def _records(cmd: list[str]) -> list[dict[str, Any]]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_cuda_training_matches_torch() -> None:
    # Every case, deterministic, on every GPU present: bit-identical at one GPU.
    nproc = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(HERE / "cuda_parity.py"), "--deterministic"]
    records = _records(cmd)
    assert len(records) == nproc * len(cuda_parity.CASES)
    assert cuda_parity.check(records) == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_cpu_offload_on_cuda_is_within_torchs_spread(deterministic: bool) -> None:
    cmd = [sys.executable, str(HERE / "cuda_offload_race.py")]
    record = _records(cmd + (["--deterministic"] if deterministic else []))[0]
    assert cuda_offload_race.check(record) == []
