"""Muon on whole models, on every mesh of the issue: torch's Muon's bits, step for step.

The models are the demo's GPT (``demo/model.py``, narrowed), a transformers Qwen2 decoder, and
transformers' Mixtral and Qwen2-MoE (experts as ``(E, out, in)`` stacks). Each is placed by
``fully_shard`` (either engine) on a 1-D mesh, on an HSDP mesh of 2 replicas, or on a
(dp, tp) mesh after tensor parallelism: the demo GPT by the demo's own ``parallelize``
(Megatron-style with sequence parallelism), Qwen2 by the plan its config ships
(``base_model_tp_plan``: q, k, v, gate and up colwise, o and down rowwise).

As in ``muon_runs``: one seed builds the placed model and a single-process copy; each step the
placed model runs its microbatches on this data-parallel rank's rows, the copy is given the
placed run's reduced gradients (full tensors), and both step: shardkit's Muon and AdamW on
the placed model, ``torch.optim.Muon`` (each expert of a stack as a 2-D parameter of its own)
and AdamW on the copy. Parameters are split by ``split_matrices(stacks=True)`` on both sides.
Equal parameters after every step means equal updates, bit for bit.
"""

from __future__ import annotations

import fnmatch
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardkit.core import MixedPrecisionPolicy
from shardkit.core.optim import Muon, MuonWithAdamW, split_matrices
from tests.core.interop.hf_models import tiny_qwen2
from tests.core.optim.muon_runs import ADAMW_LR, LR, step_against
from tests.core.optim.placement_runs import ExpertwiseMuon
from tests.core.parity import fully_shard_of, torch_policy

VOCAB, SEQ = 64, 8
MOE: dict[
    str, Any
] = {  # both MoE decoders' shared sizes: 2 layers, width 32, 4 experts of 2 a token
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One model on one mesh, trained one way; the same on both engines."""

    model: str
    """"demo_gpt", "qwen2", "mixtral" or "qwen2_moe"."""
    layout: str = "fsdp"
    """"fsdp" (every rank one shard), "hsdp" (2 replicas of W / 2 shards) or "tp" (a
    (W / 2, 2) mesh of dp and tp axes)."""
    micro: int = 1
    """Backward passes per step, each on its share of the step's rows."""
    bf16_params: bool = False
    """The model in bf16, reduced in fp32: Muon's momentum in bf16 too."""
    replicated_over: bool = False
    """Under "tp": Muon told that the TP ranks hold the same matrices TP leaves whole."""
    one: bool = False
    """The placed model's Muon and AdamW as one ``MuonWithAdamW`` (the copy keeps the pair)."""


def build(model: str) -> nn.Module:
    """The model from seed 0, the same on every rank and in the single process."""
    torch.manual_seed(0)
    if model == "demo_gpt":
        from demo.model import GPT, ModelConfig

        return GPT(ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4))
    if model == "qwen2":
        built: nn.Module = tiny_qwen2()
        return built
    if model == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(**MOE, intermediate_size=16, head_dim=8, num_local_experts=4)
        return MixtralForCausalLM(config)
    if model == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        sizes: dict[str, Any] = {"intermediate_size": 64, "moe_intermediate_size": 16}
        qwen2_moe = Qwen2MoeConfig(
            **MOE, **sizes, num_experts=4, shared_expert_intermediate_size=32
        )
        return Qwen2MoeForCausalLM(qwen2_moe)
    raise ValueError(f"unknown model {model!r}")


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (transformers' ``model.layers``) or the demo GPT's blocks."""
    inner = getattr(model, "model", model)
    name = "layers" if hasattr(inner, "layers") else "blocks"
    return list(getattr(inner, name))


def _head(model: nn.Module) -> nn.Module | None:
    """The output head where the model does not name it itself (the demo's GPT)."""
    head = getattr(model, "head", None)
    return head if isinstance(head, nn.Module) else None


def _hf_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism on a transformers decoder's layers, as its config's
    ``base_model_tp_plan`` says for its ``nn.Linear`` projections (colwise, rowwise); an MoE's
    expert stacks take no torch style and stay whole on the TP axis."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp_plan: dict[str, str] = model.config.base_model_tp_plan  # type: ignore[union-attr, assignment]
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan: dict[str, Any] = {}
    for pattern, style in tp_plan.items():
        if style in styles and fnmatch.filter(linears, f"model.{pattern}"):
            plan[f"model.{pattern}"] = styles[style]()
    parallelize_module(model, tp_mesh, plan)


def place(case: Case, model: nn.Module, impl: str, world_size: int) -> tuple[int, int]:
    """Place ``model`` as ``case.layout`` says; this rank's data-parallel index and size."""
    rank = torch.distributed.get_rank()
    fs = fully_shard_of(impl)
    kwargs: dict[str, Any] = {}
    if case.bf16_params:
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        kwargs["mp_policy"] = policy if impl == "shardkit" else torch_policy(policy)
    if case.layout == "tp":
        names = ("dp", "tp")
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=names)
        if case.model == "demo_gpt":
            from demo.train_gpt import parallelize

            assert not kwargs, "the demo's parallelize takes no policy"
            parallelize(model, mesh, fs)  # type: ignore[arg-type]
        else:
            _hf_tp(model, mesh["tp"])
            for layer in _layers(model):
                fs(layer, mesh=mesh["dp"], **kwargs)
            fs(model, mesh=mesh["dp"], **kwargs)
        return rank // 2, world_size // 2
    if case.layout == "hsdp":
        names = ("replicate", "shard")
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in _layers(model):
        fs(layer, mesh=mesh, **kwargs)
    fs(model, mesh=mesh, **kwargs)
    return rank, world_size


def _optimizers(
    model: nn.Module,
    *,
    placed: bool,
    replicated_over: DeviceMesh | None = None,
    one: bool = False,
) -> tuple[list[Any], int]:
    """Muon (shardkit's, or torch's expert by expert) and AdamW, or with ``one`` the two as
    one ``MuonWithAdamW``; how many matrices Muon has."""
    split = split_matrices(model, head=_head(model), stacks=True)
    count = sum(len(p) if p.dim() == 3 else 1 for _, p in split.matrices)
    if one:
        groups = [
            {"params": split.matrices, "use_muon": True, "lr": LR},
            {"params": split.others, "use_muon": False, "lr": ADAMW_LR, "weight_decay": 0.1},
        ]
        return [MuonWithAdamW(groups, replicated_over=replicated_over)], count
    muon = (
        Muon(split.matrices, lr=LR, replicated_over=replicated_over)
        if placed
        else ExpertwiseMuon(split.matrices)
    )
    adamw = torch.optim.AdamW([p for _, p in split.others], lr=ADAMW_LR, weight_decay=0.1)
    return [muon, adamw], count


def _tp_mesh(model: nn.Module, case: Case) -> DeviceMesh | None:
    """TP's mesh, where the case tells Muon of it: the "tp" axis of TP's own parameters."""
    if not case.replicated_over:
        return None
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            tp: DeviceMesh = mesh["tp"]
            return tp
    raise AssertionError("replicated_over: no parameter on a tp axis")


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x) if isinstance(_head(model), nn.Module) else model(input_ids=x).logits
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def backward(model: nn.Module, case: Case, step: int, dp_rank: int, dp_size: int) -> None:
    """This data-parallel rank's backward passes of step ``step``: the step's global batch, 2
    rows a data-parallel rank a microbatch."""
    gen = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (2 * dp_size * case.micro, SEQ + 1), generator=gen)
    for micro in tokens.chunk(case.micro):
        rows = micro.chunk(dp_size)[dp_rank]
        (_loss(model, rows[:, :-1], rows[:, 1:]) / case.micro).backward()


def compare_body(
    rank: int, world_size: int, *, impl: str, case: Case, steps: int
) -> dict[str, Any]:
    """Runs on every rank: ``steps`` steps placed and single-process; what matched each step.

    Returns per step whether every parameter is bitwise equal and the largest difference,
    this rank's StepStats of each step, how many matrices Muon takes (experts counted one by
    one), the names of Muon's parameters, and how many of its matrices TP left whole.
    """
    reference, model = build(case.model), build(case.model)
    if case.bf16_params:
        reference, model = reference.to(torch.bfloat16), model.to(torch.bfloat16)
    dp_rank, dp_size = place(case, model, impl, world_size)
    ours, matrices = _optimizers(
        model, placed=True, replicated_over=_tp_mesh(model, case), one=case.one
    )
    theirs, _ = _optimizers(reference, placed=False)
    muon = ours[0].muon if case.one else ours[0]
    ref_params = dict(reference.named_parameters())
    out: dict[str, Any] = {"equal": [], "max_diff": [], "stats": [], "matrices": matrices}
    for step in range(steps):
        backward(model, case, step, dp_rank, dp_size)
        equal, max_diff = step_against(model, ref_params, [*ours, *theirs])
        out["equal"].append(equal)
        out["max_diff"].append(max_diff)
        out["stats"].append(astuple(muon.last_step_stats))
    out["muon"] = [n for group in muon.param_groups for n in group["param_names"]]
    # Under TP, Muon's matrices that TP left whole: DTensors of the dp axis alone.
    out["dp_only"] = sum(
        len(p) if p.dim() == 3 else 1
        for group in muon.param_groups
        for p in group["params"]
        if case.layout == "tp" and "tp" not in (p.device_mesh.mesh_dim_names or ())
    )
    return out
