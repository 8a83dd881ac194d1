"""The CUDA path (NCCL, one process per GPU): parity with torch's fully_shard.

Skipped where CUDA is absent (CI and the CPU development machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_training_matches_torch() -> None:
    nproc = min(2, torch.cuda.device_count())
    script = Path(__file__).with_name("cuda_parity.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    out = subprocess.run(
        [*cmd, str(script)], capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(records) == nproc
    for record in records:
        ours, theirs = record["traces"]["shardkit"], record["traces"]["torch"]
        assert ours == pytest.approx(theirs, rel=1e-5)
        assert record["max_param_diff"] < 1e-5
