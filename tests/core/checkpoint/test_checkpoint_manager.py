"""CheckpointManager: atomic saves, keep the newest K, an interrupted save breaks nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, state_of, train_app


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager, IncompleteCheckpointError

    manager = CheckpointManager(root, keep=2)
    app = build_app(world_size)
    for until in (2, 4, 6):
        train_app(app, until, rank, world_size)
        manager.save(app.step, {"app": app})
    kept = [p.name for p in manager.complete()]
    app.fail = True  # the next save dies part-way, on every rank
    try:
        manager.save(7, {"app": app})
        failed = False
    except Exception:
        failed = True
    app.fail = False
    partial = Path(root) / ".step_00000007.partial"
    latest = manager.latest()
    try:
        manager.load({"app": build_app(world_size)}, partial)
        refused = ""
    except IncompleteCheckpointError as error:
        refused = str(error)
    uninterrupted = train_app(app, 9, rank, world_size)
    resumed = build_app(world_size)
    loaded = manager.load({"app": resumed})
    return {
        "kept": kept,
        "failed": failed,
        "latest": latest.name if latest else None,
        "refused": refused,
        "loaded": loaded.name if loaded else None,
        "resumed_step": resumed.step,
        "resumed": train_app(resumed, 9, rank, world_size),
        "uninterrupted": uninterrupted,
    }


def test_checkpoint_manager(tmp_path: Path) -> None:
    result = run_on_ranks(2, _body, root=str(tmp_path / "ckpt"))[0]
    assert result["kept"] == ["step_00000004", "step_00000006"]  # keep=2
    assert result["failed"]
    assert result["latest"] == "step_00000006"  # the failed save changed nothing
    assert "incomplete" in result["refused"] and "step_00000006" in result["refused"]
    assert result["loaded"] == "step_00000006" and result["resumed_step"] == 6
    assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-6)


def _fresh_body(rank: int, world_size: int, root: str) -> Any:
    from shardkit.core import CheckpointManager

    return CheckpointManager(root).load({"app": build_app(world_size)})


def test_nothing_to_resume_from_is_a_fresh_start(tmp_path: Path) -> None:
    assert run_on_ranks(2, _fresh_body, root=str(tmp_path / "none")) == [None, None]


def _corrupt(checkpoint: Path, what: str) -> None:
    """Truncate one file of a DCP checkpoint (rank 0 does it; the others wait).

    ``what``: "metadata", "distcp", or "unchecked" (a ``.distcp`` of a checkpoint without
    checksums, as older versions saved them: only DCP can find the damage); or, with every
    file intact, a marker that is not an object ("marker"), or one whose checksums name a
    file outside the checkpoint ("outside": the checkpoint before's, with its true sums).
    """
    if dist.get_rank() == 0:
        marker_path = checkpoint / "COMPLETE"
        marker = json.loads(marker_path.read_text())
        if what == "marker":
            marker_path.write_text(json.dumps([marker]))
        elif what == "outside":
            before = checkpoint.parent / "step_00000002" / ".metadata"
            sums = {"bytes": before.stat().st_size, "sha256": _sha256(before.read_bytes())}
            marker["files"]["../step_00000002/.metadata"] = sums
            marker_path.write_text(json.dumps(marker))
        else:
            victim = checkpoint / (".metadata" if what == "metadata" else "__1_0.distcp")
            victim.write_bytes(victim.read_bytes()[:-40])
        if what == "unchecked":
            del marker["files"]
            marker_path.write_text(json.dumps(marker))
    dist.barrier()


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _corrupt_body(rank: int, world_size: int, root: str, what: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    manager = CheckpointManager(root, keep=2)
    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    manager.save(2, {"app": app})
    uninterrupted = train_app(app, 4, rank, world_size)  # from step 2 on
    manager.save(4, {"app": app})
    uninterrupted += train_app(app, 6, rank, world_size)
    saved = manager.complete()
    for checkpoint in saved[-1:] if what != "all" else saved:
        _corrupt(checkpoint, "metadata" if what == "all" else what)
    resumed = build_app(world_size)
    train_app(resumed, 1, rank, world_size)  # some state to keep if nothing loads
    before = state_of(resumed)
    try:
        loaded = manager.load({"app": resumed})
    except Exception as error:
        after = state_of(resumed)
        return {
            "error": f"{type(error).__name__}: {error}",
            "unchanged": all(after[k].equal(v) for k, v in before.items()),
        }
    return {
        "loaded": loaded.name if loaded else None,
        "resumed": train_app(resumed, 6, rank, world_size),
        "uninterrupted": uninterrupted,
    }


@pytest.mark.parametrize("what", ["distcp", "metadata", "unchecked", "marker", "outside"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(
    what: str, tmp_path: Path
) -> None:
    results = run_on_ranks(2, _corrupt_body, root=str(tmp_path / "ckpt"), what=what)
    for result in results:  # every rank loaded the same, intact checkpoint
        assert result.get("loaded") == "step_00000002", result
        assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-6)


def test_when_no_checkpoint_loads_every_rank_raises_and_changes_nothing(tmp_path: Path) -> None:
    results = run_on_ranks(2, _corrupt_body, root=str(tmp_path / "ckpt"), what="all")
    for result in results:
        message = result.get("error", "")
        assert message.startswith("CheckpointLoadError"), result
        assert "step_00000004" in message and "step_00000002" in message
        assert ".metadata" in message  # what is wrong, and where
        assert result["unchanged"]
    assert results[0]["error"] == results[1]["error"]


class _Trap:
    """A value whose unpickling makes a directory: code a crafted checkpoint could run."""

    def __init__(self, witness: str) -> None:
        self.witness = witness

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.mkdir, (self.witness,))


def _crafted_body(rank: int, world_size: int, root: str, where: str) -> dict[str, Any]:
    """Step 2 is plain; step 4 runs code when unpickled: in a value, or in its ``.metadata``
    (its checksum in the marker updated, as whoever crafted it would)."""
    import hashlib
    import pickle

    from shardkit.core import CheckpointLoadError, CheckpointManager

    witness = Path(root).parent / f"ran-{rank}"
    manager = CheckpointManager(root, keep=3)
    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    manager.save(2, {"app": app, "note": "plain"})
    train_app(app, 4, rank, world_size)
    if where == "value":  # written as plain DCP would: the manager's own save refuses it
        from unittest import mock

        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from shardkit.core.checkpoint.dcp_reading import LoadableSavePlanner

        # Without its read-back of the values: the planner set up as DCP's own.
        plain = DefaultSavePlanner.set_up_planner
        with mock.patch.object(LoadableSavePlanner, "set_up_planner", plain):
            manager.save(4, {"app": app, "note": _Trap(str(witness))})
    else:
        manager.save(4, {"app": app, "note": "plain"})
    newest = Path(root) / "step_00000004"
    if where.startswith("metadata") and rank == 0:
        (newest / ".metadata").write_bytes(pickle.dumps(_Trap(str(witness))))
        marker = json.loads((newest / "COMPLETE").read_text())
        if where == "metadata":  # an older checkpoint's form, without the layout record
            (newest / "layout.json").unlink()
            del marker["files"]["layout.json"]
        data = (newest / ".metadata").read_bytes()
        marker["files"][".metadata"] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (newest / "COMPLETE").write_text(json.dumps(marker))
    dist.barrier()
    resumed = build_app(world_size)
    state: dict[str, Any] = {"app": resumed, "note": None}
    loaded = manager.load(state)
    _rmtree(Path(root) / "step_00000002")  # now only the crafted one is left
    try:
        manager.load({"app": build_app(world_size), "note": None})
        error = ""
    except CheckpointLoadError as failure:
        error = str(failure)
    return {
        "loaded": loaded.name if loaded else None,
        "note": state["note"],
        "ran": witness.exists(),
        "error": error,
    }


def _rmtree(path: Path) -> None:
    import shutil

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    dist.barrier()


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("value", "is a pickled object that weights_only refuses"),
        ("metadata", "refused: refused global posix.mkdir"),
    ],
)
def test_a_checkpoint_that_would_run_code_is_refused_before_anything_loads(
    tmp_path: Path, where: str, why: str
) -> None:
    """DCP unpickles ``.metadata`` and every value that is not a tensor with plain pickle; the
    manager reads both without running pickled code (``checkpoint/dcp_reading.py``). The
    ``.metadata`` case is a checkpoint without the layout record (torch's, or older ones)."""
    results = run_on_ranks(2, _crafted_body, root=str(tmp_path / "ckpt"), where=where)
    for result in results:
        assert result["loaded"] == "step_00000002" and result["note"] == "plain", result
        assert not result["ran"], "the crafted pickle ran"
        assert why in result["error"] and "step_00000004" in result["error"], result["error"]
        assert "part-way" not in result["error"]  # refused before DCP wrote anything
    assert results[0]["error"] == results[1]["error"]


def test_a_checkpoint_with_the_layout_record_never_unpickles_its_metadata(tmp_path: Path) -> None:
    """Its load is planned from the record (``checkpoint/local_plan/load.py``): a crafted
    ``.metadata`` (its checksum updated) is not read, so it runs nothing, and the state loads."""
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(2, _crafted_body, root=root, where="metadata_with_record")
    for result in results:
        assert result["loaded"] == "step_00000004" and result["note"] == "plain", result
        assert not result["ran"] and result["error"] == "", result


class _Note:
    """A user's own class in the state: plain data, but no load reads it without allowing it."""

    def __init__(self, text: str) -> None:
        self.text = text


def _unloadable_save_body(rank: int, world_size: int, root: str, async_save: bool) -> str:
    from shardkit.core import CheckpointManager, CheckpointSaveError

    manager = CheckpointManager(root)
    app = build_app(world_size)
    manager.save(1, {"app": app})
    try:
        manager.save(2, {"app": app, "note": _Note("hello")}, async_save=async_save)
        manager.wait()
        outcome = "saved"
    except CheckpointSaveError as error:
        outcome = str(error)
    latest = manager.latest()
    manager.close()
    return f"{outcome} | latest {latest.name if latest else None}"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_value_no_load_would_take_fails_the_save_on_every_rank(
    tmp_path: Path, async_save: bool
) -> None:
    """Found at the save, not at the restart days later: nothing is published."""
    results = run_on_ranks(
        2, _unloadable_save_body, root=str(tmp_path / "ckpt"), async_save=async_save
    )
    assert results[0] == results[1]
    assert "value 'note' is a pickled object that weights_only refuses" in results[0]
    assert "_Note" in results[0] and "add_safe_globals" in results[0]
    assert results[0].endswith("latest step_00000001")


def _publish_fails_body(rank: int, world_size: int, root: str, async_save: bool) -> dict[str, Any]:
    """Rank 0's disk is full when it publishes a save: every rank must learn it."""
    import errno
    import os

    from shardkit.core import CheckpointManager
    from shardkit.core.checkpoint import publish

    manager = CheckpointManager(root, keep=2)
    app = build_app(world_size)
    train_app(app, 2, rank, world_size)
    manager.save(app.step, {"app": app})
    train_app(app, 4, rank, world_size)
    original = publish.write_atomic

    def full_disk(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 0:
        publish.write_atomic = full_disk
    try:
        manager.save(app.step, {"app": app}, async_save=async_save)
        manager.wait()  # an asynchronous save is published here
        error, message = "", "no error"
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    finally:
        publish.write_atomic = original
    latest = manager.latest()
    manager.save(app.step, {"app": app})  # the ranks are still in step: the next save works
    now = manager.latest()
    return {
        "error": error,
        "message": message,
        "latest": latest.name if latest else None,
        "then": now.name if now else None,
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_publish_that_fails_on_rank0_raises_on_every_rank(
    async_save: bool, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    results = run_on_ranks(2, _publish_fails_body, root=str(root), async_save=async_save)
    first = results[0]
    assert first["error"] == "OSError", first
    assert first["message"].startswith(f"rank 0 could not publish {root / 'step_00000004'}: ")
    assert "No space left on device" in first["message"], first
    for result in results:
        assert result == first  # the same error; the previous checkpoint is still the latest
    assert first["latest"] == "step_00000002" and first["then"] == "step_00000004"


def _prepare_fails_body(rank: int, world_size: int, root: str) -> dict[str, str]:
    from shardkit.core import CheckpointManager

    app = build_app(world_size)
    try:
        CheckpointManager(root).save(0, {"app": app})  # root is a file: rank 0 cannot mkdir
        return {"error": "", "message": "no error"}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def test_a_save_that_rank0_cannot_prepare_raises_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "taken"
    root.write_text("not a directory")
    results = run_on_ranks(2, _prepare_fails_body, root=str(root))
    assert results[0]["error"] == "FileExistsError", results
    assert results[0]["message"].startswith("rank 0 could not prepare "), results
    assert results[1] == results[0]
