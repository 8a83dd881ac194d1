"""Asynchronous saves written by a writer process per rank (``writer="process"``).

The oracle is the synchronous save: a process-written checkpoint loads bit for bit the same.
A writer process that dies fails the save on every rank, with the same error, and the next
save starts another. Training processes killed at random moments of their saves never leave
a checkpoint that loads as complete and is not, nor a writer process behind them; after
each kill, every directory with ``.metadata`` has all the data it lists (torch's readers
take it), and every complete one a layout record consistent with its indexes and files.
The 3- and 20-kill runs are on the slow list (``make soak``): a run starts two training
processes and waits for a published save, which takes about 50 s on this machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import (
    build_app,
    loaded_state,
    same_state,
    state_of,
    train_app,
)

_REPO = Path(__file__).resolve().parents[3]


def _storages(manager: Any) -> dict[str, int]:
    return {k: b.untyped_storage().data_ptr() for k, b in manager.staging.buffers.items()}


def _equal_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    at_save = state_of(app)
    CheckpointManager(f"{root}/sync").save(2, {"app": app})
    manager = CheckpointManager(f"{root}/process", writer="process")
    manager.save(2, {"app": app}, async_save=True)
    train_app(app, 4, rank, world_size)  # changes every parameter while the child writes
    manager.wait()
    first = (_storages(manager), manager.writer_pid, manager.staging.generation)
    manager.save(4, {"app": app}, async_save=True)
    at_second = state_of(app)
    manager.wait()
    second = (_storages(manager), manager.writer_pid, manager.staging.generation)
    manager.close()
    return {
        "sync": same_state(loaded_state(f"{root}/sync", 2, world_size), at_save),
        "process": same_state(loaded_state(f"{root}/process", 2, world_size), at_save),
        "second": same_state(loaded_state(f"{root}/process", 4, world_size), at_second),
        "buffers": len(first[0]),
        "shared": all(b.is_shared() for b in manager.staging.buffers.values()),
        "reused": first == second,
        "latest": [p.name for p in manager.complete()],
    }


def test_process_written_checkpoints_equal_the_synchronous_save(tmp_path: Path) -> None:
    for result in run_on_ranks(2, _equal_body, root=str(tmp_path)):
        assert result["sync"] and result["process"] and result["second"]
        assert result["latest"] == ["step_00000002", "step_00000004"]
        # The same shared buffers, the same child, sent the buffers once (one generation).
        assert result["buffers"] > 10 and result["shared"] and result["reused"]


def _killed_child_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager, CheckpointSaveError

    app = build_app(world_size)
    train_app(app, 1, rank, world_size)
    manager = CheckpointManager(root, writer="process")
    manager.save(1, {"app": app}, async_save=True)
    manager.wait()
    child = manager.writer_pid
    assert child is not None
    if rank == 1:
        os.kill(child, signal.SIGSTOP)  # holds the next save's request unread: mid-save
    manager.save(2, {"app": app}, async_save=True)
    if rank == 1:
        os.kill(child, signal.SIGKILL)
    error = ""
    try:
        manager.wait()
    except CheckpointSaveError as raised:
        error = str(raised)
    train_app(app, 3, rank, world_size)
    manager.save(3, {"app": app}, async_save=True)
    at_save = state_of(app)
    restarted = manager.writer_pid not in (None, child)
    manager.close()
    return {
        "error": error,
        "restarted": restarted,
        "complete": [p.name for p in manager.complete()],
        "loads": same_state(loaded_state(root, 3, world_size), at_save),
    }


def test_a_writer_process_killed_mid_save_fails_it_on_every_rank(tmp_path: Path) -> None:
    results = run_on_ranks(2, _killed_child_body, root=str(tmp_path))
    errors = {result["error"] for result in results}
    assert len(errors) == 1  # the same error on every rank
    (error,) = errors
    assert "step 2" in error and "rank 1" in error and "writer process" in error
    assert results[1]["restarted"]  # the next save started another child
    for result in results:
        assert result["complete"] == ["step_00000001", "step_00000003"]
        assert result["loads"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _launch(run: int, tmp: Path, steps: int) -> list[subprocess.Popen[bytes]]:
    path = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "tests.core.checkpoint.process_writer_rig"]
    args = [str(tmp / f"store{run}"), str(tmp / "root"), str(tmp / "report"), str(steps)]
    return [subprocess.Popen([*command, str(rank), *args], cwd=_REPO, env=env) for rank in range(2)]


def _writers(report: Path) -> list[int]:
    pids = []
    for rank in range(2):
        path = report / f"writer-rank{rank}"
        text = path.read_text() if path.exists() else ""
        if text.isdigit():
            pids.append(int(text))
    return pids


def _latest(root: Path) -> str:
    pointer = root / "latest"
    return pointer.read_text() if pointer.exists() else ""


def _what_readers_take(root: Path) -> tuple[list[str], int]:
    """What is wrong with the directories under ``root`` that a reader would take; and how
    many hold ``.metadata`` but no ``COMPLETE`` marker (saves killed between the two).

    torch's readers take any directory with ``.metadata``: every item it lists must lie
    inside its data file. The manager takes those with ``COMPLETE``: each must have a layout
    record that reads and agrees with its indexes (``recorded_problems``).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from shardkit.core.checkpoint.local_plan.layout_record import read_record
    from shardkit.core.checkpoint.local_plan.load import recorded_problems

    problems: list[str] = []
    between = 0
    for folder in sorted(p for p in root.glob("*step_*") if p.is_dir()):
        complete = (folder / "COMPLETE").is_file()
        if (folder / ".metadata").is_file():
            between += not complete
            # This test's own files: torch's reader unpickles them, as torch's dcp.load does.
            for index, where in FileSystemReader(str(folder)).read_metadata().storage_data.items():
                data = folder / where.relative_path
                size = data.stat().st_size if data.is_file() else -1
                if where.offset + where.length > size:
                    problems.append(f"{folder.name}: {index.fqn} past the end of {data.name}")
        elif complete:
            problems.append(f"{folder.name} is complete without .metadata")
        if complete:
            try:
                problems += recorded_problems(folder, read_record(folder), 0, 1)
            except Exception as error:
                problems.append(f"{folder.name}: {error}")
    return problems, between


def _wait_until(condition: Any, what: str, limit_s: float = 60.0) -> None:
    # A bound on waiting for liveness (a hang fails the test instead of stalling it), not on
    # how fast anything runs.
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {limit_s} s")
        time.sleep(0.05)


@pytest.mark.parametrize("kills", [3, 20])
def test_killed_training_processes_leave_no_false_complete_checkpoint(
    tmp_path: Path, kills: int
) -> None:
    report = tmp_path / "report"
    report.mkdir()
    chance = random.Random(kills)
    leftover_writers: list[int] = []
    unreadable: list[str] = []
    killed_between = 0
    for run in range(kills):
        for stale in report.glob("writer-rank*"):
            stale.unlink()
        before = _latest(tmp_path / "root")
        ranks = _launch(run, tmp_path, steps=10_000)
        # One save published in this run (so that every run adds checkpoints to check), then
        # a random moment of the saves that follow: each step saves, so one is always in flight.
        _wait_until(lambda was=before: _latest(tmp_path / "root") != was, "a save published", 300.0)
        time.sleep(chance.uniform(0.0, 1.0))
        for process in chance.sample(ranks, 2):
            process.send_signal(signal.SIGKILL)
        for process in ranks:
            process.wait()
        writers = _writers(report)
        try:
            _wait_until(
                lambda pids=writers: not any(_alive(pid) for pid in pids), "the writers to exit"
            )
        except AssertionError:
            leftover_writers += [pid for pid in writers if _alive(pid)]
            for pid in writers:
                os.kill(pid, signal.SIGKILL)
        problems, between = _what_readers_take(tmp_path / "root")
        unreadable += problems
        killed_between += between
    final = _launch(kills, tmp_path, steps=0)  # verifies every complete checkpoint, then ends
    assert all(process.wait() == 0 for process in final)
    verified = [json.loads(path.read_text()) for path in report.glob("verify-*.json")]
    assert len(verified) == 2 * (kills + 1)
    checked = sum(len(found["checked"]) for found in verified)
    false_complete = [step for found in verified for step in found["false_complete"]]
    assert checked > 0  # checkpoints were published between the kills, and checked
    assert false_complete == []
    assert leftover_writers == []
    assert unreadable == []  # torch's readers never see .metadata before all data is written
    print(f"{killed_between} directories held .metadata without COMPLETE after a kill")
