"""CheckpointManager: atomic saves, keep the newest K, an interrupted save breaks nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply


class _App:
    """Model + optimizer + step as one DCP Stateful (what a training script saves)."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step, self.fail = model, optimizer, 0, False

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise OSError("disk full (simulated)")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.step = int(state["step"])


def _app(world_size: int) -> _App:
    model = models.build("gpt")
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    return _App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(app: _App, until: int, rank: int, world_size: int) -> list[float]:
    losses = []
    while app.step < until:
        x, y = models.batch("gpt", app.step, 2 * world_size)
        loss = models.loss_of(
            "gpt", app.model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]
        )
        loss.backward()
        app.optimizer.step()
        app.optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
        app.step += 1
    return losses


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager, IncompleteCheckpointError

    manager = CheckpointManager(root, keep=2)
    app = _app(world_size)
    for until in (2, 4, 6):
        _train(app, until, rank, world_size)
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
        manager.load({"app": _app(world_size)}, partial)
        refused = ""
    except IncompleteCheckpointError as error:
        refused = str(error)
    uninterrupted = _train(app, 9, rank, world_size)
    resumed = _app(world_size)
    loaded = manager.load({"app": resumed})
    return {
        "kept": kept,
        "failed": failed,
        "latest": latest.name if latest else None,
        "refused": refused,
        "loaded": loaded.name if loaded else None,
        "resumed_step": resumed.step,
        "resumed": _train(resumed, 9, rank, world_size),
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

    return CheckpointManager(root).load({"app": _app(world_size)})


def test_nothing_to_resume_from_is_a_fresh_start(tmp_path: Path) -> None:
    assert run_on_ranks(2, _fresh_body, root=str(tmp_path / "none")) == [None, None]


def _state_of(app: _App) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, full, for comparing before and after."""
    out = {f"param.{k}": _full(v) for k, v in app.model.state_dict().items()}
    for index, state in enumerate(app.optimizer.state.values()):
        out.update({f"optim.{index}.{name}": _full(v) for name, v in state.items()})
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _corrupt(checkpoint: Path, what: str) -> None:
    """Truncate one file of a DCP checkpoint (rank 0 does it; the others wait).

    ``what``: "metadata", "distcp", or "unchecked" (a ``.distcp`` of a checkpoint without
    checksums, as older versions saved them: only DCP can find the damage).
    """
    if dist.get_rank() == 0:
        victim = checkpoint / (".metadata" if what == "metadata" else "__1_0.distcp")
        victim.write_bytes(victim.read_bytes()[:-40])
        if what == "unchecked":
            marker = json.loads((checkpoint / "COMPLETE").read_text())
            del marker["files"]
            (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    dist.barrier()


def _corrupt_body(rank: int, world_size: int, root: str, what: str) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    manager = CheckpointManager(root, keep=2)
    app = _app(world_size)
    _train(app, 2, rank, world_size)
    manager.save(2, {"app": app})
    uninterrupted = _train(app, 4, rank, world_size)  # from step 2 on
    manager.save(4, {"app": app})
    uninterrupted += _train(app, 6, rank, world_size)
    saved = manager.complete()
    for checkpoint in saved[-1:] if what != "all" else saved:
        _corrupt(checkpoint, "metadata" if what == "all" else what)
    resumed = _app(world_size)
    _train(resumed, 1, rank, world_size)  # some state to keep if nothing loads
    before = _state_of(resumed)
    try:
        loaded = manager.load({"app": resumed})
    except Exception as error:
        after = _state_of(resumed)
        return {
            "error": f"{type(error).__name__}: {error}",
            "unchanged": all(after[k].equal(v) for k, v in before.items()),
        }
    return {
        "loaded": loaded.name if loaded else None,
        "resumed": _train(resumed, 6, rank, world_size),
        "uninterrupted": uninterrupted,
    }


@pytest.mark.parametrize("what", ["distcp", "metadata", "unchecked"])
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
