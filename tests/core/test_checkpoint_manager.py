"""CheckpointManager: atomic saves, keep the newest K, an interrupted save breaks nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

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
