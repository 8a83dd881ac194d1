"""torchrun --max-restarts brings the demo back after a worker is SIGKILLed, exactly.

With torch's default init, a restarted worker shares the launcher's store with its dead
predecessor and about half the restarts failed to connect (demo/train_gpt.py
`init_distributed`). The job must end normally, and its losses (resumed from the latest
checkpoint) must be those of a run that was never killed, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--d-model=64", "--n-layers=2", "--seq-len=32", "--log-every=1"]


def _command(ckpt: Path, metrics: Path, steps: int, restarts: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [f"--max-restarts={restarts}", str(REPO / "demo" / "train_gpt.py"), f"--steps={steps}"]
    cmd += [f"--ckpt-dir={ckpt}", "--ckpt-every=3", "--auto-resume", f"--metrics-file={metrics}"]
    return cmd + SMALL


def _losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}


def _workers(launcher: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == launcher:
                    found.append(int(entry.name))
    return found


def test_a_killed_worker_is_restarted_and_training_goes_on_exactly(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reference = tmp_path / "reference.jsonl"
    done = subprocess.run(
        _command(tmp_path / "ref_ckpt", reference, 12, 0), env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = tmp_path / "job.jsonl"
    job = subprocess.Popen(
        _command(tmp_path / "ckpt", metrics, 12, 2), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    killed = False
    while job.poll() is None and time.monotonic() < deadline:
        if not killed and metrics.exists() and max(_losses(metrics), default=0) >= 7:
            workers = _workers(job.pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
                killed = True
        time.sleep(0.1)
    output, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert killed, "the job ended before a worker could be killed"
    assert job.returncode == 0, output[-3000:]
    assert "resumed from" in output, output[-3000:]
    assert _losses(metrics) == _losses(reference)
