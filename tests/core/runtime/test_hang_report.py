"""Hang reports: a rank stuck in a collective logs where every rank is, every rank says why.

Real jobs under torchrun, with SHARDKIT_HANG_TIMEOUT=2 (``hang_job.py``):

- rank 1 runs an extra forward and backward at the end of training and waits in its first
  all-gather, while rank 0 waits in a final barrier;
- rank 1 skips its last backward and goes on to an all-reduce of its own, while rank 0 waits
  in that backward's all-gather.

The rank that waits reports and exits within seconds instead of the process group's 30
minutes, and so does every other rank, with its own report, before the job is torn down
(each rank's output is read from its own log). The watching thread itself stops at exit
(before the interpreter tears down) and is replaced when collectives start on a new process
group.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.pool import run_on_ranks

REPO = Path(__file__).resolve().parents[3]


def _run_job(mode: str, logs: Path) -> tuple[int, str, dict[int, str]]:
    """Run ``hang_job.py mode`` on 2 ranks: its status, torchrun's output, each rank's log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--log-dir", str(logs), "--redirects", "3"]  # each rank's output in its own file
    cmd += [str(REPO / "tests" / "core" / "runtime" / "hang_job.py"), mode]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDKIT_HANG_TIMEOUT="2", PYTHONPATH=str(REPO))
    # The limit only stops a broken test; the job ends seconds after the 2 s hang timeout.
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    ranks: dict[int, str] = {}
    for rank in (0, 1):
        found = sorted(logs.glob(f"*/attempt_0/{rank}/stderr.log"))
        ranks[rank] = found[0].read_text() if found else ""
    return job.returncode, job.stdout + job.stderr, ranks


def _report_of(rank: int, log: str, opening: str) -> str:
    """The report in ``log`` that begins with ``shardkit: rank <rank> <opening>``."""
    start = log.find(f"shardkit: rank {rank} {opening}")
    assert start >= 0, f"no report of rank {rank} in its own output:\n{log[-3000:]}"
    return log[start:]


def test_a_rank_left_waiting_reports_and_the_job_ends(tmp_path: Path) -> None:
    status, output, logs = _run_job("extra_step", tmp_path)
    assert status != 0, output[-3000:]
    assert "exitcode  : 124" in output, output[-3000:]
    report = _report_of(1, logs[1], "has waited")
    assert "this rank waits on all-gather of <root> in forward, step 4" in report, report
    # rank 0 went elsewhere (a final barrier): named, with the last collective it reached
    assert (
        "rank 0: in step 4, idle, not in a shardkit collective; last reached reduce-sca" in report
    )
    assert "in extra_step" in report  # the Python stack shows where rank 1 is
    # Rank 0, in a barrier of the program's own, says so too before the job ends.
    other = _report_of(0, logs[0], "stops: rank 1 gave up waiting")
    assert "on all-gather of <root> in forward, step 4" in other, other
    assert "this rank is in step 4, idle, not in a shardkit collective" in other, other
    assert "Python stacks of rank 0" in other and "dist.barrier()" in other, other


def test_a_rank_that_skips_a_backward_and_the_one_left_waiting_both_report(
    tmp_path: Path,
) -> None:
    status, output, logs = _run_job("skip_backward", tmp_path)
    assert status != 0, output[-3000:]
    assert "exitcode  : 124" in output, output[-3000:]
    waiting = _report_of(0, logs[0], "has waited")
    assert "this rank waits on all-gather of blocks.2 in backward, step 4" in waiting, waiting
    assert "rank 1: in step 4, forward, not in a shardkit collective" in waiting, waiting
    astray = _report_of(1, logs[1], "stops: rank 0 gave up waiting")
    assert "on all-gather of blocks.2 in backward, step 4" in astray, astray
    assert "this rank is in step 4, forward, not in a shardkit collective" in astray, astray
    assert "in skipped_backward" in astray and "dist.all_reduce(loss)" in astray, astray
    # Reported before the job was torn down, not after a gloo error that explains nothing.
    assert "Connection closed" not in logs[1].split("shardkit: rank 1 stops")[0], logs[1]


def _stop_and_restart_body(rank: int, world_size: int) -> dict[str, bool]:
    """Stop the watch as exit does, then let the next collectives start a new one."""
    from shardkit.core.runtime.watch import hang

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


def _alarm_body(rank: int, world_size: int) -> dict[str, Any]:
    """Alarms in the store: one left by an earlier process group, then one raised now."""
    import torch.distributed as dist

    from shardkit.core.runtime.groups import progress_store
    from shardkit.core.runtime.watch import hang

    hang._stop_watching()  # the worker's own watch would exit the process on the alarm
    store = progress_store()
    assert store is not None, "the pool's process group has a store"
    alarm = {"rank": 1, "token": "earlier", "detail": "an earlier job's wait"}
    if rank == 0:
        store.set("alarm", json.dumps(alarm))
    dist.barrier()
    exits: list[int] = []
    watch = hang.HangWatch(exit_process=exits.append)
    stale = watch.check()  # left by an earlier process group on this store: not this job's
    dist.barrier()
    if rank == 0:
        alarm = {"rank": 1, "token": "now", "detail": "all-gather of blocks.0 in forward, step 2"}
        store.set("alarm", json.dumps(alarm))
    dist.barrier()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    hang.logger.addHandler(handler)
    try:
        fresh = watch.check()  # every rank reports, and waits for the others' reports
    finally:
        hang.logger.removeHandler(handler)
    dist.barrier()
    return {"stale": stale, "fresh": fresh, "exits": exits, "logged": records}


def test_every_rank_reports_on_an_alarm_and_ignores_an_earlier_one() -> None:
    for rank, result in enumerate(run_on_ranks(2, _alarm_body)):
        assert not result["stale"], result
        assert result["fresh"] and result["exits"] == [124], result
        (report,) = result["logged"]  # no "exits without the reports of" line: both reported
        assert report.startswith(
            f"shardkit: rank {rank} stops: rank 1 gave up waiting (SHARDKIT_HANG_TIMEOUT="
        ), report
        assert (
            "on all-gather of blocks.0 in forward, step 2, which this rank did not join" in report
        )
        # Checked here from the main thread, whose stack the report leaves out as its own.
        assert f"exiting with status 124; Python stacks of rank {rank}:" in report, report
