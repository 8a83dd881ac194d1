"""The demo with tensor parallelism: dp 2 x tp 2 trains, checkpoints, and the checkpoint
resumes at dp 4 x tp 1 (plain FSDP) with the loss going on as in the 2D run.

The 2D run trains 6 steps and saves at steps 4 and 6; its steps 5 and 6 are the reference.
Its step-6 checkpoint is deleted, so that the resumed run starts from step 4, as a user rolls
back to an earlier checkpoint (``latest`` names a folder that is gone: the newest complete
one loads). The resumed run is the demo's training function on the test pool's 4 ranks
(tests/demo/in_pool.py): one torchrun launch fewer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.demo.in_pool import losses, train_in_pool

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--d-model=64", "--n-layers=2", "--seq-len=32", "--log-every=1"]


def _run(metrics: Path, *args: str) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(REPO / "demo" / "train_gpt.py"), f"--metrics-file={metrics}", *SMALL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return losses(metrics)


def test_2d_checkpoint_resumes_at_dp4_tp1(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reference = _run(
        tmp_path / "job1.jsonl", "--tp=2", "--steps=6", f"--ckpt-dir={ckpt}", "--ckpt-every=4"
    )
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]
    shutil.rmtree(ckpt / "step_00000006")
    resumed, _ = train_in_pool(
        [
            *SMALL,
            "--tp=1",
            "--batch-size=4",  # dp 4 x 4 rows: the 2D run's global batch (dp 2 x 8 rows)
            "--steps=6",
            f"--ckpt-dir={ckpt}",
            "--resume",
        ],
        tmp_path / "job2.jsonl",
    )
    assert sorted(resumed) == [5, 6]
    for step in (5, 6):
        assert abs(resumed[step] - reference[step]) < 1e-4, (step, resumed, reference)
