"""The oracle for shardkit.legacy: torch's own FSDP1, built in the same processes.

Both wrappers get the same model (same seed), the same FSDP1 arguments (each from its own
library) and the same data; a body returns, per implementation, the global loss of every
step and every parameter after the last step (full tensors through summon_full_params).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models

Trace = dict[str, Any]  # {"losses": [...], "params": {name: tensor}, "grads": {...}}


@dataclass(kw_only=True)
class LegacyRun:
    """One differential experiment: FSDP1's arguments by name, and how to train."""

    model: str = "mlp"
    steps: int = 5
    strategy: str = "FULL_SHARD"
    wrap: str = "blocks"  # "blocks": ModuleWrapPolicy of the model's blocks; "none"
    mixed_precision: dict[str, Any] | None = None  # MixedPrecision's fields
    cpu_offload: bool = False
    hybrid_mesh: tuple[int, int] | None = None  # device_mesh (replicate, shard) for HYBRID
    hybrid_groups: bool = False  # with hybrid_mesh: pass its (shard, replicate) process groups
    optimizer: str = "sgd"  # "sgd" (momentum), "plain" (SGD, no momentum) or "adamw"
    lr: float = 0.05
    per_rank_batch: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # more FSDP1 arguments
    ignored: tuple[str, ...] = ()  # submodules passed as ignored_states
    impls: tuple[str, ...] = ("shardkit", "torch")


def lib(impl: str) -> Any:
    """The FSDP1 namespace of an implementation: shardkit.legacy or torch's."""
    if impl == "shardkit":
        import shardkit.legacy as ours

        return ours
    import torch.distributed.fsdp as theirs
    import torch.distributed.fsdp.wrap as wrap

    class Namespace:
        pass

    ns: Any = Namespace()
    for source in (theirs, wrap):
        for name in dir(source):
            if not name.startswith("__"):
                setattr(ns, name, getattr(source, name))
    ns.FSDP = theirs.FullyShardedDataParallel
    return ns


def block_classes(model: str) -> set[type[nn.Module]]:
    """The model's transformer-block classes (what auto-wrapping wraps)."""
    if model == "mlp":
        return {models.Block}
    from shardkit.tools.plan.gpt import GPTBlock

    return {GPTBlock}


def fsdp_kwargs(impl: str, run: LegacyRun) -> dict[str, Any]:
    """FSDP1's constructor arguments for ``run``, from ``impl``'s library."""
    ns = lib(impl)
    kwargs: dict[str, Any] = dict(run.extra)
    kwargs["device_id"] = torch.device("cpu")
    kwargs["sharding_strategy"] = getattr(ns.ShardingStrategy, run.strategy)
    if run.wrap == "blocks":
        kwargs["auto_wrap_policy"] = ns.ModuleWrapPolicy(block_classes(run.model))
    if run.mixed_precision is not None:
        kwargs["mixed_precision"] = ns.MixedPrecision(**run.mixed_precision)
    if run.cpu_offload and impl == "shardkit":
        # FSDP1's offload pins its CPU shards, which fails on a machine without an
        # accelerator; offloading moves no value, so FSDP1 without it is the oracle.
        kwargs["cpu_offload"] = ns.CPUOffload(offload_params=True)
    if run.hybrid_mesh is not None:
        mesh = init_device_mesh("cpu", run.hybrid_mesh, mesh_dim_names=("replicate", "shard"))
        if run.hybrid_groups:  # FSDP1's other way: (intra-node, inter-node) process groups
            kwargs["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
        else:
            kwargs["device_mesh"] = mesh
    return kwargs


def wrap_model(impl: str, run: LegacyRun, model: nn.Module | None = None) -> Any:
    """A fresh model of ``run`` wrapped by ``impl``'s FSDP1."""
    model = model if model is not None else models.build(run.model)
    kwargs = fsdp_kwargs(impl, run)
    if run.ignored:
        kwargs["ignored_states"] = [model.get_submodule(name) for name in run.ignored]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib(impl).FSDP(model, **kwargs)


def make_optimizer(run: LegacyRun, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``run`` over ``model.parameters()``."""
    if run.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.1)
    if run.optimizer == "plain":
        return torch.optim.SGD(model.parameters(), lr=run.lr)
    return torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)


def rank_batch(run: LegacyRun, step: int, rank: int, world_size: int) -> tuple[Any, Any]:
    """This rank's slice of step ``step``'s global batch."""
    x, y = models.batch(run.model, step, world_size * run.per_rank_batch)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    """The mean of every rank's loss."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / world_size


def full_params(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, full, by clean name (inside the implementation's summon)."""
    with lib(impl).FSDP.summon_full_params(model, writeback=False):
        return {name: p.detach().clone().float() for name, p in model.named_parameters()}


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, run: LegacyRun, steps: range
) -> list[float]:
    """Train ``model`` on steps ``steps`` of ``run``'s data; the global losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = rank_batch(run, step, rank, world_size)
        loss = models.loss_of(run.model, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, world_size))
    return losses


def train(impl: str, run: LegacyRun, rank: int, world_size: int) -> Trace:
    """Train ``impl`` for ``run.steps`` steps and return its trace."""
    model = wrap_model(impl, run)
    losses = train_steps(model, make_optimizer(run, model), run, range(run.steps))
    return {"losses": losses, "params": full_params(impl, model)}


def parity_body(rank: int, world_size: int, runs: list[LegacyRun]) -> list[dict[str, Trace]]:
    """Runs on every rank: each run with every implementation."""
    return [{impl: train(impl, run, rank, world_size) for impl in run.impls} for run in runs]


def assert_close_traces(
    ours: Trace, theirs: Trace, *, rtol: float = 1e-5, atol: float = 1e-6, what: str = ""
) -> None:
    """Same losses and same parameters (by name) within tolerance."""
    torch.testing.assert_close(
        torch.tensor(ours["losses"]),
        torch.tensor(theirs["losses"]),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what} losses: {m}",
    )
    assert ours["params"].keys() == theirs["params"].keys(), what
    for name, value in ours["params"].items():
        try:
            torch.testing.assert_close(value, theirs["params"][name], rtol=rtol, atol=atol)
        except AssertionError as error:
            raise AssertionError(f"{what} {name}: {error}") from None
