"""Whole-matrix optimizers on sharded models against a single process, step for step.

Both sides start from one seed. Each step the sharded model runs its forward and backward on
its rank's slice of the batch; the single process is then given the sharded run's reduced
gradients (the full tensors) and steps its own optimizers. Gradients reduced across ranks do
not have a single process's bits (sums in another order), so this compares what the optimizers
do with the same gradients: equal parameters after every step means equal updates, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import astuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.core.parity import fully_shard_of

LR = 0.02
ADAMW_LR = 1e-3


def build(name: str) -> nn.Module:
    """A model from a fixed seed.

    "mlp": MLPNet, its head 3 rows (uneven at W=2) and its input 16 x 7 (tall); "gpt": a tiny
    GPT, two blocks of each matrix shape (batched on their owners); "one": a single 5 x 4
    matrix (fewer matrices than ranks, uneven rows).
    """
    if name == "one":
        torch.manual_seed(0)
        return nn.Linear(4, 5, bias=False)
    model: nn.Module = models.build(name)
    return model


def takes_muon(model_name: str, param_name: str, param: torch.Tensor) -> bool:
    """Whether a parameter takes the whole-matrix optimizer (the rest take AdamW).

    The MLP gives every matrix, its head too (3 rows: uneven); the GPT its blocks' matrices,
    keeping the embeddings and the head on AdamW, as users do.
    """
    if param.dim() != 2:
        return False
    return model_name != "gpt" or param_name.startswith("blocks.")


def shard(model: nn.Module, impl: str, world_size: int) -> None:
    """``fully_shard`` (``impl``'s) on each block, then the root."""
    fs = fully_shard_of(impl)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in getattr(model, "blocks", []):
        fs(block, mesh=mesh)
    fs(model, mesh=mesh)


def batch(name: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (the whole batch for world_size 1)."""
    if name == "one":
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = (
            torch.randn(2 * world_size, 4, generator=gen),
            torch.randn(2 * world_size, 5, generator=gen),
        )
    else:
        x, y = models.batch(name, step, 2 * world_size)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target) if name == "one" else models.loss_of(name, out, target)


def full(t: torch.Tensor) -> torch.Tensor:
    """A full, plain copy of a parameter or gradient (a collective for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def step_against(
    model: nn.Module, ref_params: Mapping[str, torch.Tensor], opts: list[Any]
) -> tuple[bool, float]:
    """One step of both sides after the sharded run's backward: the single process's
    parameters (``ref_params``, by name) are given the sharded run's reduced gradients as full
    tensors, every optimizer of ``opts`` (both sides') steps; then whether every parameter is
    bitwise equal on both sides, and the largest difference."""
    for name, p in model.named_parameters():
        ref_params[name].grad = None if p.grad is None else full(p.grad)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    pairs = [(full(p), ref_params[n].detach()) for n, p in model.named_parameters()]
    equal = all(torch.equal(a, b) for a, b in pairs)
    return equal, max((a.float() - b.float()).abs().max().item() for a, b in pairs)


Optimizers = Callable[
    [list[tuple[str, nn.Parameter]], list[nn.Parameter]], list[torch.optim.Optimizer]
]


def muon_pair(sharded: bool) -> Optimizers:
    """shardkit's Muon (sharded) or torch's (single process), each beside torch's AdamW."""

    def make(matrices: list[tuple[str, nn.Parameter]], others: list[nn.Parameter]) -> list[Any]:
        from shardkit.core.optim import Muon

        muon = (
            Muon(matrices, lr=LR) if sharded else torch.optim.Muon([p for _, p in matrices], lr=LR)
        )
        return [muon, torch.optim.AdamW(others, lr=ADAMW_LR)] if others else [muon]

    return make


def compare_body(
    rank: int,
    world_size: int,
    *,
    impl: str,
    model: str,
    steps: int,
    ours: str = "muon",
    rounds: int = 1,
) -> dict[str, Any]:
    """Runs on every rank: ``steps`` steps sharded and single-process; what matched each step.

    ``ours``: "muon" (shardkit's Muon against torch's) or "column_norm" (ColumnNormSGD against
    :func:`column_norm_reference`). ``rounds``: the sharded optimizer's ``exchange_rounds``.
    Returns per step whether every parameter is bitwise equal and the largest difference, and
    this rank's StepStats of each step.
    """
    reference, sharded = build(model), build(model)
    shard(sharded, impl, world_size)
    if ours == "muon":
        ref_opts = _split(model, reference, muon_pair(sharded=False))
        our_opts = _split(model, sharded, muon_pair(sharded=True))
    else:
        ref_opts = [ColumnNormReference([p for _, p in _matrices(model, reference)])]
        our_opts = _split(model, sharded, _column_norm)
    our_opts[0].exchange_rounds = rounds  # type: ignore[attr-defined]
    out: dict[str, Any] = {"equal": [], "max_diff": [], "stats": []}
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        x, y = batch(model, step, rank, world_size)
        loss_of(model, sharded(x), y).backward()
        equal, max_diff = step_against(sharded, ref_params, [*our_opts, *ref_opts])
        out["equal"].append(equal)
        out["max_diff"].append(max_diff)
        stats = getattr(our_opts[0], "last_step_stats", None)
        out["stats"].append(astuple(stats) if stats is not None else None)
    return out


def _matrices(model_name: str, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if takes_muon(model_name, n, p)]


def _split(model_name: str, model: nn.Module, make: Optimizers) -> list[torch.optim.Optimizer]:
    matrices = _matrices(model_name, model)
    taken = {id(p) for _, p in matrices}
    others = [p for p in model.parameters() if id(p) not in taken]
    return make(matrices, others)


def _column_norm(matrices: list[tuple[str, nn.Parameter]], others: list[nn.Parameter]) -> list[Any]:
    from shardkit.core.optim import ColumnNormSGD

    del others  # left as they are, on both sides
    return [ColumnNormSGD(matrices, lr=LR, momentum=0.9)]


class ColumnNormReference(torch.optim.Optimizer):
    """ColumnNormSGD written for one process, from its definition, on whole tensors."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": LR, "momentum": 0.9, "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                norms = torch.linalg.vector_norm(buf, dim=0, keepdim=True)
                p.add_(buf / norms.clamp(min=group["eps"]), alpha=-group["lr"])
