"""Muon on the ways models train: accumulated gradients, bf16, a transformers decoder.

As in ``muon_runs``: one seed builds the sharded model and a single-process copy; each step
the sharded model runs its microbatches, the copy is given the sharded run's reduced
gradients, and both step (shardkit's Muon and AdamW sharded; ``torch.optim.Muon`` and AdamW on
the copy). Equal parameters after every step means equal updates, bit for bit. The parameters
are split by ``split_matrices`` on both sides, so the helper is what users would call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardkit.core import MixedPrecisionPolicy
from shardkit.core.optim import Muon, split_matrices
from tests.core import models
from tests.core.interop.hf_models import tiny_qwen2
from tests.core.optim.muon_runs import ADAMW_LR, LR, step_against
from tests.core.parity import fully_shard_of, torch_policy


@dataclass(frozen=True, kw_only=True)
class Path:
    """One way of training, the same on both engines."""

    model: str = "gpt"
    """"gpt" (the test GPT) or "qwen2" (a tiny transformers Qwen2ForCausalLM)."""
    micro: int = 1
    """Backward passes per step, each on its share of the step's batch."""
    no_sync: bool = False
    """With ``micro`` > 1: ``set_requires_gradient_sync(False)`` on all but the last."""
    mixed: bool = False
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on fp32 parameters."""
    bf16_params: bool = False
    """The model itself in bf16 (its reduce in fp32): Muon's momentum in bf16 too."""


def _build(path: Path) -> tuple[nn.Module, list[nn.Module]]:
    """The model and the modules it is sharded by, each then the root."""
    if path.model == "qwen2":
        model = tiny_qwen2()  # a two-layer decoder, vocabulary 64, width 32
        layers = list(model.model.layers)
    else:
        model = models.build("gpt")
        layers = list(model.blocks)
    return (model.to(torch.bfloat16) if path.bf16_params else model), layers


def _shard(model: nn.Module, layers: list[nn.Module], path: Path, impl: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    kwargs: dict[str, Any] = {
        "mesh": init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    }
    if path.mixed or path.bf16_params:
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if path.mixed else None, reduce_dtype=torch.float32
        )
        kwargs["mp_policy"] = policy if impl == "shardkit" else torch_policy(policy)
    fs = fully_shard_of(impl)
    for layer in layers:
        fs(layer, **kwargs)
    fs(model, **kwargs)


def _optimizers(model: nn.Module, *, sharded: bool) -> list[torch.optim.Optimizer]:
    split = split_matrices(model, head=getattr(model, "head", None))
    matrices = split.matrices
    muon: torch.optim.Optimizer = (
        Muon(matrices, lr=LR) if sharded else torch.optim.Muon([p for _, p in matrices], lr=LR)
    )
    others = [p for _, p in split.others]
    return [muon, torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.1)]


def _loss(path: Path, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x).logits if path.model == "qwen2" else model(x)
    return models.loss_of("gpt", out, y)


def paths_body(rank: int, world_size: int, impl: str, path: Path, steps: int) -> dict[str, Any]:
    """Runs on every rank; per step, whether the two sides hold equal parameters, and the
    largest difference; the names of the parameters Muon took."""
    reference, _ = _build(path)
    model, layers = _build(path)
    _shard(model, layers, path, impl)
    ours, theirs = _optimizers(model, sharded=True), _optimizers(reference, sharded=False)
    ref_params = dict(reference.named_parameters())
    out: dict[str, Any] = {"equal": [], "max_diff": [], "muon": []}
    for step in range(steps):
        # The step's global batch, 2 rows a rank a microbatch: microbatch i of rank r.
        x, y = models.batch("gpt", step, 2 * world_size * path.micro)
        for i, (xs, ys) in enumerate(zip(x.chunk(path.micro), y.chunk(path.micro), strict=True)):
            if path.no_sync:
                model.set_requires_gradient_sync(i == path.micro - 1)  # type: ignore[operator]
            xr, yr = xs.chunk(world_size)[rank], ys.chunk(world_size)[rank]
            (_loss(path, model, xr, yr) / path.micro).backward()
        equal, max_diff = step_against(model, ref_params, [*ours, *theirs])
        out["equal"].append(equal)
        out["max_diff"].append(max_diff)
    out["muon"] = [n for group in ours[0].param_groups for n in group["param_names"]]
    return out
