"""Soak: 300 steps at W=2 under torchrun --max-restarts, with 5 ranks SIGKILLed on the way.

The kills fall mid-forward, mid-backward, mid-save (while the state is staged), inside DCP's
background writer (an asynchronous save in flight) and one more at random, each on a random
rank, at random steps (seeded: SHARDKIT_SOAK_SEED, default 0), by the test rig
(tests/demo/rig.py), which runs the example's own training. torchrun restarts the job each
time and the demo resumes from its newest checkpoint. The final loss curve, every loss
recomputed after a restart, and the exported model must be bit-identical to a run that was
never killed. Prints the steps lost per kill. Slow (minutes): `make soak`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.demo.soak import EVERY, KILLS, SMALL, STEPS, check_against_reference, kill_points

REPO = Path(__file__).resolve().parents[2]


def _run(ckpt: Path, metrics: Path, restarts: int, rig: list[str]) -> None:
    """The example on 2 ranks, or the test rig with `rig`'s options (run from the repo root)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [f"--max-restarts={restarts}"]
    cmd += ["-m", "tests.demo.rig", *rig] if rig else [str(REPO / "demo" / "train_gpt.py")]
    cmd += [f"--steps={STEPS}", f"--ckpt-dir={ckpt}", f"--ckpt-every={EVERY}", "--auto-resume"]
    cmd += [f"--metrics-file={metrics}", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_soak_five_kills_bit_identical(tmp_path: Path) -> None:
    started = time.monotonic()
    reference = tmp_path / "reference.jsonl"
    _run(tmp_path / "ref", reference, 0, [])
    reference_s = time.monotonic() - started
    kills = kill_points(int(os.environ.get("SHARDKIT_SOAK_SEED", "0")))
    log = tmp_path / "kills.log"
    rig = [f"--kill-at={','.join(map(str, kills))}", f"--kill-log={log}"]
    metrics = tmp_path / "soak.jsonl"
    _run(tmp_path / "soak", metrics, KILLS + 1, rig)
    soak_s = time.monotonic() - started - reference_s

    assert log.read_text().split() == [str(k) for k in kills]  # each fired, once, in order
    resumes = check_against_reference(reference, metrics, tmp_path / "ref", tmp_path / "soak")
    lost = [(r.done, r.step) for r in resumes]

    print(f"\nsoak: {STEPS} steps, W=2, checkpoints every {EVERY} (async), {KILLS} kills")
    print(f"uninterrupted run {reference_s:.0f} s; killed and restarted run {soak_s:.0f} s")
    print("kill  rank  step  phase        last logged step  resumed from  steps lost")
    assert len(lost) == KILLS, lost
    for index, (kill, (done, resumed)) in enumerate(zip(kills, lost, strict=True)):
        print(f"{index + 1:4d}  {kill.rank:4d}  {kill.step:4d}  {kill.phase:11s}  "
              f"{done:16d}  {resumed:12d}  {done - resumed:10d}")  # fmt: skip
        # At most one save is in flight, and the next save publishes it first: a kill inside
        # that save, before it published, resumes two intervals back.
        assert done - resumed <= 2 * EVERY + 1, (kill, done, resumed)  # +1: a step logged after
