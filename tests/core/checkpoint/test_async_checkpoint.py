"""Asynchronous saves: the state at the moment of the save, written while training goes on.

The oracle is the synchronous save of the same state: both load back bit for bit the same.
A failed background write raises on every rank and is never published.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import (
    build_app,
    loaded_state,
    same_state,
    state_of,
    train_app,
)


def _async_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    at_save = state_of(app)
    CheckpointManager(f"{root}/sync").save(2, {"app": app})
    manager = CheckpointManager(f"{root}/async")
    manager.save(2, {"app": app}, async_save=True)
    pending = manager.pending
    latest_while_pending = manager.latest()
    train_app(app, 4, rank, world_size)  # changes every parameter while the write goes on
    published = manager.wait()
    storages = {k: b.untyped_storage().data_ptr() for k, b in manager.staging.buffers.items()}
    with manager:  # a second save reuses the buffers; leaving the block publishes it
        manager.save(4, {"app": app}, async_save=True)
    again = {k: b.untyped_storage().data_ptr() for k, b in manager.staging.buffers.items()}
    return {
        "pending": pending.name if pending else None,
        "latest_while_pending": latest_while_pending,
        "published": published.name if published else None,
        "latest": [p.name for p in manager.complete()],
        "sync_is_the_state": same_state(loaded_state(f"{root}/sync", 2, world_size), at_save),
        "async_is_the_state": same_state(loaded_state(f"{root}/async", 2, world_size), at_save),
        "trained_on": not same_state(state_of(app), at_save),
        "buffers": len(storages),
        "reused": storages == again,
    }


def test_an_async_save_holds_the_state_at_save_time_bit_for_bit(tmp_path: Path) -> None:
    for result in run_on_ranks(2, _async_body, root=str(tmp_path)):
        assert result["pending"] == "step_00000002"
        assert result["latest_while_pending"] is None  # not current until published
        assert result["published"] == "step_00000002"
        assert result["latest"] == ["step_00000002", "step_00000004"]
        assert result["trained_on"]  # the steps after the save changed the live state...
        assert result["sync_is_the_state"]
        assert result["async_is_the_state"]  # ...and none of them reached the checkpoint
        assert result["buffers"] > 10 and result["reused"]


class _Unwritable:
    """A value that stages (deep copy) but cannot be serialized: the background write fails."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Unwritable:
        return self

    def __reduce__(self) -> Any:
        raise OSError("disk full (simulated)")


def _failing_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager, CheckpointSaveError

    manager = CheckpointManager(root)
    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    manager.save(2, {"app": app}, async_save=True)
    train_app(app, 3, rank, world_size)
    poison = {"extra": _Unwritable()} if rank == 1 else {}
    manager.save(3, {"app": app, **poison}, async_save=True)  # publishes step 2 first
    train_app(app, 4, rank, world_size)
    try:
        manager.wait()
        error = ""
    except CheckpointSaveError as raised:
        error = str(raised)
    after = manager.latest()
    hidden = sorted(p.name for p in Path(root).glob(".step_*"))
    manager.save(4, {"app": app}, async_save=True)  # the manager goes on working
    manager.close()
    dist.barrier()
    return {
        "error": error,
        "latest": after.name if after else None,
        "hidden": hidden,
        "then": [p.name for p in manager.complete()],
    }


def test_a_failed_background_write_raises_everywhere_and_is_never_published(
    tmp_path: Path,
) -> None:
    results = run_on_ranks(2, _failing_body, root=str(tmp_path / "ckpt"))
    assert results[0]["error"] == results[1]["error"]  # the same error on every rank
    message = results[0]["error"]
    assert "step 3" in message and "disk full (simulated)" in message, message
    assert "still step_00000002" in message, message
    for result in results:
        assert result["latest"] == "step_00000002"
        assert result["hidden"] == [".step_00000003.partial"]  # written, never published
        assert result["then"] == ["step_00000002", "step_00000004"]
