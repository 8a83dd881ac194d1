"""The replicate tests' runs: one model replicated (and sharded) by shardkit or by torch, trained.

torch's ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``) is the oracle:
each run applies torch's ``replicate`` and ``fully_shard`` or shardkit's, in one of the
``LAYOUTS``, trains the same steps on the same data, and returns every step's global loss,
the full gradients of the last step (before the optimizer's step) and the full parameters
after it. ``local`` is the single process on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.core import models
from tests.core.ckpt_helpers import model_values, optim_values
from tests.core.parity import global_loss, rank_batch, torch_policy

Trace = dict[str, Any]

LAYOUTS = ("replicate", "replicate_blocks_shard_root", "shard_blocks_replicate_root")
"""Every block and the root replicated; blocks replicated under a sharded root (torch's
mixed test); blocks sharded under a replicated root."""


@dataclass(frozen=True, kw_only=True)
class ReplicateRun:
    """One experiment: which model, how it is wrapped, and how it trains."""

    model: str = "gpt"
    layout: str = "replicate"
    mixed: bool = False
    """bf16 parameters, fp32 gradient reduction (``MixedPrecisionPolicy``)."""
    accumulate: bool = False
    """Two microbatches a step, the first without gradient sync."""
    steps: int = 4
    impls: tuple[str, ...] = ("shardkit", "torch")


def apis(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``impl``'s (replicate, fully_shard)."""
    if impl == "shardkit":
        from shardkit.core import fully_shard, replicate

        return replicate, fully_shard
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_replicate, torch_fully_shard


def wrap(impl: str, model: nn.Module, layout: str, mixed: bool, world_size: int) -> None:
    """Apply ``impl``'s APIs to ``model``'s blocks and root as ``layout`` says."""
    replicate, fully_shard = apis(impl)
    # Named: torch's replicate before 2.11 refuses a mesh without names.
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed:
        from shardkit.core import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs["mp_policy"] = policy if impl == "shardkit" else torch_policy(policy)
    blocks_api, root_api = {
        "replicate": (replicate, replicate),
        "replicate_blocks_shard_root": (replicate, fully_shard),
        "shard_blocks_replicate_root": (fully_shard, replicate),
    }[layout]
    for block in model.blocks:  # type: ignore[union-attr]
        blocks_api(block, **kwargs)
    root_api(model, **kwargs)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().clone()


def train(impl: str, run: ReplicateRun, rank: int, world_size: int) -> Trace:
    """Train ``impl`` as ``run`` says; its trace."""
    model = models.build(run.model)
    if impl != "local":
        wrap(impl, model, run.layout, run.mixed, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(run.steps):
        x, y = rank_batch(run.model, step, rank, world_size, impl, per_rank=4)
        micro = list(zip(x.chunk(2), y.chunk(2), strict=True)) if run.accumulate else [(x, y)]
        total = torch.zeros(())
        for index, (a, b) in enumerate(micro):
            if impl != "local":
                model.set_requires_gradient_sync(index == len(micro) - 1)
            loss = models.loss_of(run.model, model(a), b) / len(micro)
            loss.backward()
            total += loss.detach()
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(total, impl, world_size))
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "kinds": _kinds(model)}


def _kinds(model: nn.Module) -> dict[str, str]:
    """Each parameter's placements as text (what each layout made of it)."""
    return {
        n: str(p.placements) if isinstance(p, DTensor) else "plain"
        for n, p in model.named_parameters()
    }


def train_body(rank: int, world_size: int, run: ReplicateRun) -> dict[str, Trace]:
    """Runs on every rank: each implementation of ``run`` in turn."""
    return {impl: train(impl, run, rank, world_size) for impl in run.impls}


def _trained(impl: str, layout: str, world_size: int, rank: int, seed: int) -> Any:
    """``impl``'s model in ``layout`` with AdamW, after one step (the moments exist)."""
    model = models.build("gpt", seed=seed)
    wrap(impl, model, layout, False, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = rank_batch("gpt", seed, rank, world_size, impl)
    models.loss_of("gpt", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def dcp_save_body(rank: int, world_size: int, impl: str, layout: str, path: str) -> dict[str, Any]:
    """Save ``impl``'s trained model and optimizer with DCP; their full values as saved."""
    model, opt = _trained(impl, layout, world_size, rank, seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    return {"model": model_values(model), "optim": optim_values(model, opt)}


def dcp_load_body(rank: int, world_size: int, impl: str, layout: str, path: str) -> dict[str, Any]:
    """Load ``path`` into ``impl``'s model trained from another seed; its full values then."""
    model, opt = _trained(impl, layout, world_size, rank, seed=5)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return {"model": model_values(model), "optim": optim_values(model, opt)}
