"""Muon on every placement against a single process: HSDP, FSDP x TP, replicate, MoE stacks.

As in ``muon_runs.py``: both sides start from one seed, the sharded model runs forward and
backward on its rank's slice of the batch, and the single process is given the sharded run's
reduced gradients (full tensors) and steps torch's Muon and AdamW. Equal parameters after
every step means equal updates, bit for bit.

A 3-D expert stack is E matrices: torch's Muon refuses 3-D parameters (its step checks each
gradient is 2-D), so the single process steps each expert as a 2-D parameter of its own and
copies it back into the stack.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core.optim.muon_runs import (
    ADAMW_LR,
    LR,
    batch,
    build,
    full,
    loss_of,
    step_against,
    takes_muon,
)
from tests.core.parity import fully_shard_of

MOE_VOCAB, MOE_SEQ = 64, 8


def _replicate_of(impl: str) -> Any:
    if impl == "shardkit":
        from shardkit.core import replicate

        return replicate
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    return torch_replicate


def _blocks_then_root(api: Any, model: nn.Module, blocks: list[nn.Module], **kwargs: Any) -> None:
    for block in blocks:
        api(block, **kwargs)
    api(model, **kwargs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    found = getattr(inner, "layers", None) or getattr(model, "blocks", None) or []
    return list(found)


def build_moe(experts: int = 4) -> nn.Module:
    """A tiny transformers Qwen3-MoE: 2 layers, hidden 32, ``experts`` experts as 3-D stacks."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: taken by its kwargs
        vocab_size=MOE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def _tp_setup(
    impl: str, model: str, world_size: int, replicas: bool = False
) -> tuple[nn.Module, nn.Module]:
    """A TP tests' model ("mlp": colwise, rowwise, colwise; "sp": with sequence parallelism)
    on a (dp, tp) mesh, sharded on dp; with ``replicas``, a (dp_replicate, dp_shard, tp) mesh
    of (2, 1, W / 2), HSDP x TP."""
    from tests.tp import tp_models
    from tests.tp.tp_parity import TPRun, build_sharded, global_mesh

    shape = (2, 1, world_size // 2) if replicas else (2, world_size // 2)
    run = TPRun(model=model, mesh=shape)
    return tp_models.build(model), build_sharded(impl, run, global_mesh(run))


def setup(layout: str, model: str, impl: str, world_size: int) -> tuple[nn.Module, nn.Module]:
    """(single-process model, sharded model) of ``model`` placed as ``layout`` says."""
    if layout in ("tp", "hsdp_tp"):
        return _tp_setup(impl, model, world_size, replicas=layout == "hsdp_tp")
    if model.startswith("moe"):
        experts = int(model[3:] or 4)
        reference, sharded = build_moe(experts), build_moe(experts)
    else:
        reference, sharded = build(model), build(model)
    if layout == "hsdp":
        names = ("replicate", "shard")
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=names)
        _blocks_then_root(fully_shard_of(impl), sharded, _blocks(sharded), mesh=mesh)
    elif layout == "replicate":
        _blocks_then_root(_replicate_of(impl), sharded, _blocks(sharded))
    else:  # "fsdp", or "shard1": the columns cut instead of the rows
        mesh = init_device_mesh("cpu", (world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if layout == "shard1":
            from torch.distributed.tensor import Shard

            # shardkit's engine, as torch's, takes uneven cuts on dim 0 only.
            def cut(p: torch.Tensor) -> Shard:
                return Shard(1) if p.ndim == 2 and p.shape[1] % world_size == 0 else Shard(0)

            kwargs["shard_placement_fn"] = cut
        _blocks_then_root(fully_shard_of(impl), sharded, _blocks(sharded), **kwargs)
    return reference, sharded


def takes_muon_in(layout: str, model: str, name: str, param: torch.Tensor) -> bool:
    """Muon's parameters: the TP MLP's weights; a MoE's experts and attention; else muon_runs'."""
    if layout in ("tp", "hsdp_tp"):
        return param.dim() == 2
    if model.startswith("moe"):
        return ".experts." in name or (".self_attn." in name and name.endswith("proj.weight"))
    return takes_muon(model, name, param)


def _batch(layout: str, model: str, step: int, rank: int, world_size: int) -> Any:
    if layout in ("tp", "hsdp_tp"):
        from tests.tp import tp_models

        dp_rank, dp_size = rank // (world_size // 2), 2
        x, y = tp_models.batch(model, step, 2 * dp_size)
        return x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    if model.startswith("moe"):
        gen = torch.Generator().manual_seed(3000 + step)
        tokens = torch.randint(0, MOE_VOCAB, (2 * world_size, MOE_SEQ), generator=gen)
        return tokens.chunk(world_size)[rank], None
    return batch(model, step, rank, world_size)


def _loss(layout: str, model_name: str, model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    if layout in ("tp", "hsdp_tp"):
        return F.mse_loss(model(x), y)
    if model_name.startswith("moe"):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    return loss_of(model_name, model(x), y)


class ExpertwiseMuon:
    """torch's Muon with each expert of a stack as a 2-D parameter of its own (the oracle)."""

    def __init__(self, matrices: list[tuple[str, nn.Parameter]]) -> None:
        self.stacks = [p for _, p in matrices if p.dim() == 3]
        self.experts = [
            [nn.Parameter(p.detach()[e].clone()) for e in range(len(p))] for p in self.stacks
        ]
        flat = [e for es in self.experts for e in es]
        plain = [p for _, p in matrices if p.dim() == 2]
        self.muon = torch.optim.Muon([*plain, *flat], lr=LR)

    def step(self) -> None:
        for stack, experts in zip(self.stacks, self.experts, strict=True):
            for e, expert in enumerate(experts):
                expert.grad = None if stack.grad is None else stack.grad[e].clone()
        self.muon.step()
        with torch.no_grad():
            for stack, experts in zip(self.stacks, self.experts, strict=True):
                for e, expert in enumerate(experts):
                    stack[e].copy_(expert)

    def zero_grad(self) -> None:
        self.muon.zero_grad()


def _optimizers(layout: str, model_name: str, model: nn.Module, sharded: bool) -> list[Any]:
    from shardkit.core.optim import Muon

    matrices = [
        (n, p) for n, p in model.named_parameters() if takes_muon_in(layout, model_name, n, p)
    ]
    taken = {id(p) for _, p in matrices}
    others = [p for p in model.parameters() if id(p) not in taken]
    muon = Muon(matrices, lr=LR) if sharded else ExpertwiseMuon(matrices)
    return [muon, torch.optim.AdamW(others, lr=ADAMW_LR)] if others else [muon]


def compare_body(
    rank: int, world_size: int, *, impl: str, layout: str, model: str, steps: int
) -> dict[str, Any]:
    """Runs on every rank: ``steps`` steps placed and single-process; what matched each step.

    Returns per step whether every parameter is bitwise equal and the largest difference, this
    rank's StepStats of each step, and how many matrices Muon takes (experts counted apart).
    """
    reference, placed = setup(layout, model, impl, world_size)
    ref_opts = _optimizers(layout, model, reference, sharded=False)
    our_opts = _optimizers(layout, model, placed, sharded=True)
    ref_params = dict(reference.named_parameters())
    out: dict[str, Any] = {"equal": [], "max_diff": [], "stats": []}
    out["matrices"] = sum(
        len(p) if p.dim() == 3 else 1
        for n, p in reference.named_parameters()
        if takes_muon_in(layout, model, n, p)
    )
    for step in range(steps):
        x, y = _batch(layout, model, step, rank, world_size)
        _loss(layout, model, placed, x, y).backward()
        equal, max_diff = step_against(placed, ref_params, [*our_opts, *ref_opts])
        out["equal"].append(equal)
        out["max_diff"].append(max_diff)
        out["stats"].append(astuple(our_opts[0].last_step_stats))
    return out


def stages_body(rank: int, world_size: int, *, steps: int) -> list[bool]:
    """Two pipeline stages, each with a matrix of its own shape on its own (dp, tp) slice.

    Each stage's Muon makes its group from its own slice (the root mesh flattened as
    ``fully_shard`` flattens it), so the stages need not build the same optimizer. Returns,
    per step, whether the matrix equals torch's Muon's on the full tensor.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardkit.core.optim import Muon

    root = init_device_mesh("cpu", (2, 1, world_size // 2), mesh_dim_names=("pp", "dp", "tp"))
    coordinate = root.get_coordinate()
    assert coordinate is not None
    stage = coordinate[0]
    gen = torch.Generator().manual_seed(stage)
    shape = (6, 4) if stage == 0 else (10, 8)
    whole, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    mesh, cut = root["dp", "tp"], [Shard(0), Shard(1)]
    param = nn.Parameter(distribute_tensor(whole, mesh, cut, src_data_rank=None))
    reference = nn.Parameter(whole.clone())
    ours, theirs = Muon([param], lr=LR), torch.optim.Muon([reference], lr=LR)
    equal = []
    for _ in range(steps):
        param.grad = distribute_tensor(grad, mesh, cut, src_data_rank=None)
        reference.grad = grad.clone()
        ours.step()
        theirs.step()
        equal.append(torch.equal(full(param), reference.detach()))
    return equal
