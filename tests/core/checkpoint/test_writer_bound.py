"""A writer process that hangs without dying fails the save within a bound (issue 85).

``writer="process"``: rank 1's child is stopped (SIGSTOP: alive, never answering) before a
save. Its rank's request to it must end at the bound (``SHARDKIT_CHECKPOINT_WRITER_BOUND_S``,
set small here), the child be killed, and every rank raise the same ``CheckpointSaveError``,
naming rank 1 and the bound; the next save starts another child and is published. Without the
bound the save would never end (the pool's timeout would fail the test).
"""

from __future__ import annotations

import os
import signal
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

_BOUND_S = "4"


def _hung_child_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager, CheckpointSaveError

    os.environ["SHARDKIT_CHECKPOINT_WRITER_BOUND_S"] = _BOUND_S
    try:
        app = build_app(world_size)
        manager = CheckpointManager(root, writer="process")
        errors: dict[int, str] = {}
        children: dict[int, int | None] = {}
        for step in (1, 2, 3):  # rank 1's child stopped before the save of step 2
            train_app(app, step, rank, world_size)
            if step == 2 and rank == 1 and children[1] is not None:
                os.kill(children[1], signal.SIGSTOP)  # alive, and never answering
            manager.save(step, {"app": app}, async_save=True)
            at_save = state_of(app)
            try:
                manager.wait()
            except CheckpointSaveError as raised:
                errors[step] = str(raised)
            children[step] = manager.writer_pid
        manager.close()
        return {
            "errors": errors,
            "gone": rank != 1 or not Path(f"/proc/{children[1]}").exists(),
            "restarted": children[3] not in (None, children[1]),
            "complete": [p.name for p in manager.complete()],
            "loads": same_state(loaded_state(root, 3, world_size), at_save),
        }
    finally:
        del os.environ["SHARDKIT_CHECKPOINT_WRITER_BOUND_S"]


def test_a_writer_process_that_hangs_fails_the_save_on_every_rank_within_the_bound(
    tmp_path: Path,
) -> None:
    results = run_on_ranks(2, _hung_child_body, root=str(tmp_path))
    assert all(list(result["errors"]) == [2] for result in results), results
    errors = {result["errors"][2] for result in results}
    assert len(errors) == 1, errors  # the same error on every rank
    (error,) = errors
    assert "step 2" in error and "rank 1" in error, error
    assert f"did not answer within {_BOUND_S} s" in error, error
    assert results[1]["gone"]  # the stopped child was killed
    assert results[1]["restarted"]  # the next save started another
    for result in results:
        assert result["complete"] == ["step_00000001", "step_00000003"]
        assert result["loads"]


@pytest.mark.parametrize("text", ["0", "-3", "soon"])
def test_a_bound_that_is_not_a_positive_number_is_refused(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit.core.checkpoint.process_writer import WriterProcess

    monkeypatch.setenv("SHARDKIT_CHECKPOINT_WRITER_BOUND_S", text)
    with pytest.raises(ValueError, match="SHARDKIT_CHECKPOINT_WRITER_BOUND_S must be a positive"):
        WriterProcess()
