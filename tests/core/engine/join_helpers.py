"""Shared by the Join tests: the models, each rank's batches, SGD that records its gradients,
the sharded model, the oracle, and the comparison with it.

Each rank's batches follow from the iteration and the rank, so every rank can compute the
oracle alone: ``tests.core.replica_oracle``'s unsharded replicas, a rank taking part in the
iterations it has batches for.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.core.parity import fully_shard_of, rank_batch
from tests.core.replica_oracle import ReplicaTraining, Turn, train_replicas

__all__ = [
    "ATOL",
    "RTOL",
    "HeadRoot",
    "RecordingSGD",
    "assert_matches_oracle",
    "batch",
    "build",
    "data_of",
    "full_grad",
    "loss",
    "oracle",
    "recorded",
    "replicas",
    "sharded",
    "syncs",
]

RTOL = 1e-5
ATOL = 1e-6


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps every parameter's full gradient at each step, to compare with the oracle.

    A sharded gradient is gathered (a collective): every rank steps in the same iterations,
    the joined one from its join hook, so they gather together.
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.seen.append([full_grad(g) for g in grads if g is not None])
        return super().step(closure)


def recorded(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """A recording optimizer's gradients at each step (another optimizer records none)."""
    return optimizer.seen if isinstance(optimizer, RecordingSGD) else []


def full_grad(grad: torch.Tensor) -> torch.Tensor:
    full = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return full.detach().clone()


class HeadRoot(nn.Module):
    """Blocks, then a head held by the root: the root's gradients are complete first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.Block(7) for _ in range(2))
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def build(model: str) -> Any:
    """``mlp``: the root holds an input projection and a head, so its gradients are complete
    last; ``head_root``: first; ``gpt_tied``: its embedding is the head's weight;
    ``mlp_frozen``: a block with a frozen norm, whose backward ends through its inputs."""
    if model == "head_root":
        torch.manual_seed(0)
        return HeadRoot()
    if model == "mlp_frozen":
        built = models.build("mlp")
        built.blocks[1].norm.requires_grad_(False)
        return built
    return models.build(model)


def data_of(model: str) -> str:
    return "mlp" if model in ("head_root", "mlp_frozen") else model.removesuffix("_tied")


def batch(model: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_batch(data_of(model), step, rank, world_size, "shardkit")


def loss(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return models.loss_of(data_of(model), out, target)


def syncs(step: int, accumulate: bool) -> bool:
    """With accumulation, two micro-batches per optimizer step: the second syncs."""
    return not accumulate or step % 2 == 1


def replicas(
    name: str, world_size: int, counts: list[int], *, accumulate: bool = False
) -> ReplicaTraining:
    """The oracle's training: rank ``r`` runs iterations ``0 .. counts[r] - 1``, each
    iteration's gradient divided by the world size, ``RecordingSGD`` steps (replace any of it).
    """
    micro_batches = 2 if accumulate else 1  # as ``syncs`` says

    def turn_loss(model: nn.Module, turn: Turn) -> torch.Tensor | None:
        if turn.iteration >= counts[turn.rank]:
            return None  # out of batches
        x, y = batch(name, turn.iteration, turn.rank, world_size)
        return loss(name, model(x), y)

    return ReplicaTraining(
        make_model=lambda: build(name),
        loss=turn_loss,
        world_size=world_size,
        steps=max(counts) // micro_batches,  # a window left open never steps
        micro_batches=micro_batches,
        optimizer=lambda model: RecordingSGD(model.parameters()),
    )


def oracle(training: ReplicaTraining) -> dict[str, Any]:
    """The replicas' final parameters and the gradients their optimizer stepped with."""
    run = train_replicas(training)
    return {"params": run.params, "grads": recorded(run.optimizer)}


def sharded(
    world_size: int, mesh_shape: tuple[int, ...], name: str = "mlp", bf16: bool = False
) -> Any:
    from shardkit.core import MixedPrecisionPolicy

    model = build(name)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    fully_shard = fully_shard_of("shardkit")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": policy} if bf16 else {"mesh": mesh}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def assert_matches_oracle(
    results: list[dict[str, Any]],
    rtol: float = RTOL,
    atol: float = ATOL,
    grad_tolerances: tuple[float, float] = (RTOL, ATOL),
) -> None:
    for rank, result in enumerate(results):
        expected = result["expected"]
        for name, value in result["params"].items():
            torch.testing.assert_close(
                value, expected["params"][name], rtol=rtol, atol=atol, msg=f"rank {rank}: {name}"
            )
        assert len(result["grads"]) == len(expected["grads"]), f"rank {rank}: optimizer steps"
        for step, (ours, theirs) in enumerate(zip(result["grads"], expected["grads"], strict=True)):
            torch.testing.assert_close(
                ours,
                theirs,
                rtol=grad_tolerances[0],
                atol=grad_tolerances[1],
                msg=f"rank {rank}: gradients at step {step}",
            )
