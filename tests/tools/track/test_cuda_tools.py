"""The trackers on CUDA with NCCL; skipped where CUDA is absent (CI and CPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tools.track.cuda_tools_run import check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_trackers_on_cuda() -> None:
    nproc = min(2, torch.cuda.device_count())
    script = Path(__file__).with_name("cuda_tools_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert check(records, nproc) == []
