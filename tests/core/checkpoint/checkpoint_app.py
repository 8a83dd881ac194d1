"""A training app for checkpoint tests: model, optimizer and step as one DCP Stateful."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.core.parity import Run, apply

__all__ = [
    "TrainingApp",
    "build_app",
    "full_value",
    "loaded_state",
    "same_state",
    "state_of",
    "train_app",
]


class TrainingApp:
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


def build_app(
    world_size: int,
    model_name: str = "gpt",
    replicas: int = 1,
    seed: int = 0,
    impl: str = "shardkit",
) -> TrainingApp:
    """``replicas`` > 1: HSDP, ``replicas`` copies of FSDP over ``world_size // replicas``.

    ``seed``: other initial weights than the default (a state that a load must replace).
    ``impl``: whose ``fully_shard`` shards it, ``"shardkit"`` or ``"torch"``."""
    model = models.build(model_name, seed)
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        shape = (replicas, world_size // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    apply(impl, model, mesh, Run(model=model_name))
    return TrainingApp(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_app(app: TrainingApp, until: int, rank: int, world_size: int) -> list[float]:
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


def state_of(app: TrainingApp) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, full, for comparing before and after."""
    out = {f"param.{k}": full_value(v) for k, v in app.model.state_dict().items()}
    for index, state in enumerate(app.optimizer.state.values()):
        out.update({f"optim.{index}.{name}": full_value(v) for name, v in state.items()})
    return out


def full_value(value: torch.Tensor) -> torch.Tensor:
    # Without autograd: a parameter's full_tensor() would otherwise make a to-local autograd
    # node, whose release is where torch's double free was caught (note 002).
    with torch.no_grad():
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys, every value bit for bit (two ``state_of`` results)."""
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def loaded_state(root: str, step: int, world_size: int) -> dict[str, torch.Tensor]:
    """A fresh app's ``state_of`` after loading step ``step`` of the manager at ``root``."""
    from shardkit.core import CheckpointManager

    app = build_app(world_size)
    manager = CheckpointManager(root)
    manager.load({"app": app}, manager.path_for(step))
    return state_of(app)
