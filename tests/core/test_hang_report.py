"""Hang reports: a rank stuck in a collective logs where every rank is, and the job ends.

A real job under torchrun: rank 1 runs an extra forward and backward at the end of training
and waits in its first all-gather; rank 0 waits in a final barrier. With
SHARDKIT_HANG_TIMEOUT=2, rank 1 reports and exits within seconds instead of the process
group's 30 minutes. The watching thread itself stops at exit (before the interpreter tears
down) and is replaced when collectives start on a new process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.pool import run_on_ranks

REPO = Path(__file__).resolve().parents[2]


def test_a_rank_left_waiting_reports_and_the_job_ends() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd.append(str(REPO / "tests" / "core" / "hang_job.py"))
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDKIT_HANG_TIMEOUT="2", PYTHONPATH=str(REPO))
    # The limit only stops a broken test; the job ends seconds after the 2 s hang timeout.
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    start = output.find("shardkit: rank 1 has waited")
    assert start >= 0, output[-3000:]
    report = output[start:]
    assert "this rank waits on all-gather of <root> in forward, step 4" in report, report
    # rank 0 went elsewhere (a final barrier): named, with the last collective it reached
    assert (
        "rank 0: in step 4, idle, not in a shardkit collective; last reached reduce-sca" in report
    )
    assert "in extra_step" in report  # the Python stack shows where rank 1 is


def _stop_and_restart_body(rank: int, world_size: int) -> dict[str, bool]:
    """Stop the watch as exit does, then let the next collectives start a new one."""
    from shardkit.core.runtime import hang

    hang.ensure_watching()  # running already if this worker ran collectives before
    first = hang._WATCH[0]
    was_alive = first.is_alive()
    hang._stop_watching()  # what atexit runs before the interpreter tears down
    stopped = not first.is_alive()
    hang.ensure_watching()  # a new process group's collectives: a new watch
    second = hang._WATCH[0]
    return {
        "was_alive": was_alive,
        "stopped": stopped,
        "replaced": second is not first and second.is_alive(),
    }


def test_the_watch_stops_at_exit_and_a_new_one_starts_after() -> None:
    for result in run_on_ranks(2, _stop_and_restart_body):
        assert result == {"was_alive": True, "stopped": True, "replaced": True}
