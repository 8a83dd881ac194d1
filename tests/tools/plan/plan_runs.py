"""Sharding plans for the tiny GPT, the same configurations written by hand, and their training.

Each plan in ``PLANS`` has a twin in ``BY_HAND``: the calls a script would write for it with
torch's own ``fully_shard``, ``checkpoint_wrapper`` and prefetch setters, the oracle that
``apply_plan`` (either engine) and the generated ``parallelize`` must match bit for bit.
A body trains 3 AdamW steps at W ranks and returns every step's global loss and the full
parameters after the last step (names without ``_checkpoint_wrapped_module``).
"""

from __future__ import annotations

import functools
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from shardkit.tools.plan.sharding_plan import ROOT, CheckpointMode, ShardingPlan, Unit
from tests.core import models
from tests.core.parity import global_loss, rank_batch

DEPTH = 4
STEPS = 3

PLANS: dict[str, ShardingPlan] = {
    # One unit per block, the last block kept gathered, two units prefetched, every block
    # recomputed in full.
    "blocks": ShardingPlan(
        units=(
            *(Unit(modules=(f"blocks.{i}",)) for i in range(DEPTH - 1)),
            Unit(modules=(f"blocks.{DEPTH - 1}",), reshard_after_forward=False),
            Unit(modules=(ROOT,), reshard_after_forward=False),
        ),
        prefetch=2,
        checkpoint=tuple((f"blocks.{i}", "full") for i in range(DEPTH)),
    ),
    # Embeddings, pairs of blocks and the head each one unit; selective recomputation; bf16
    # parameters with fp32 reduction.
    "pairs": ShardingPlan(
        units=(
            Unit(modules=("tok", "pos")),
            Unit(modules=("blocks.0", "blocks.1")),
            Unit(modules=("blocks.2", "blocks.3")),
            Unit(modules=("ln_f", "head"), reshard_after_forward=False),
            Unit(modules=(ROOT,)),
        ),
        prefetch=2,
        checkpoint=tuple((f"blocks.{i}", "selective") for i in range(DEPTH)),
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    ),
    # Attention and MLP of each block apart, the token embedding and the head apart; one MLP
    # recomputed in full, one selectively (their units shard the wrappers).
    "parts": ShardingPlan(
        units=(
            Unit(modules=("tok",)),
            *(
                Unit(modules=(f"blocks.{i}.{part}",), reshard_after_forward=part == "mlp" or 2)
                for i in range(DEPTH)
                for part in ("attn", "mlp")
            ),
            Unit(modules=("head",), reshard_after_forward=False),
            Unit(modules=(ROOT,), reshard_after_forward=False),
        ),
        checkpoint=(("blocks.1.mlp", "full"), ("blocks.2.mlp", "selective")),
    ),
}

_SAVED = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
]


def _wrap(module: nn.Module, selective: bool = False) -> nn.Module:
    if selective:
        context = functools.partial(create_selective_checkpoint_contexts, _SAVED)
        return checkpoint_wrapper(
            module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context
        )
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _prefetch(units: list[Any], k: int) -> None:
    for i, unit in enumerate(units):
        if units[i + 1 : i + 1 + k]:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + k])
        if i > 0:
            unit.set_modules_to_backward_prefetch(units[max(0, i - k) : i][::-1])


def _blocks_by_hand(model: Any, mesh: DeviceMesh) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _wrap(block)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i != DEPTH - 1)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    _prefetch(list(model.blocks), 2)


def _pairs_by_hand(model: Any, mesh: DeviceMesh) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _wrap(block, selective=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard([model.tok, model.pos], mesh=mesh, mp_policy=mp)
    fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh, mp_policy=mp)
    fully_shard([model.blocks[2], model.blocks[3]], mesh=mesh, mp_policy=mp)
    fully_shard([model.ln_f, model.head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    _prefetch([model.tok, model.blocks[0], model.blocks[2], model.ln_f], 2)


def _parts_by_hand(model: Any, mesh: DeviceMesh) -> None:
    model.blocks[1].mlp = _wrap(model.blocks[1].mlp)
    model.blocks[2].mlp = _wrap(model.blocks[2].mlp, selective=True)
    fully_shard(model.tok, mesh=mesh)
    for block in model.blocks:
        fully_shard(block.attn, mesh=mesh, reshard_after_forward=2)
        fully_shard(block.mlp, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.head, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


BY_HAND: dict[str, Callable[[Any, DeviceMesh], None]] = {
    "blocks": _blocks_by_hand,
    "pairs": _pairs_by_hand,
    "parts": _parts_by_hand,
}


def build() -> Any:
    """The tiny GPT with ``DEPTH`` blocks, the same on every rank."""
    torch.manual_seed(0)
    return models.TinyGPT(depth=DEPTH)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().clone()


def train(model: nn.Module, rank: int, world_size: int) -> dict[str, Any]:
    """``STEPS`` AdamW steps of a sharded ``model``: global losses and full parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses: list[float] = []
    for step in range(STEPS):
        x, y = rank_batch("gpt", step, rank, world_size, "dist")
        loss = models.loss_of("gpt", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, "dist", world_size))
    params = {
        name.replace("_checkpoint_wrapped_module.", ""): _full(p)
        for name, p in model.named_parameters()
    }
    wrapped = sum("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    return {"losses": losses, "params": params, "wrapped": wrapped}


def shard(how: str, plan: ShardingPlan, model: Any, mesh: DeviceMesh) -> None:
    """Shard ``model`` by ``how``: ``shardkit`` or ``torch`` (apply_plan on that engine),
    ``json`` (shardkit's, the plan read back from a file ``dump_plan`` wrote), or
    ``source_<engine>`` (``parallelize_source``'s function run; ``_model``: written knowing
    the model)."""
    from shardkit.tools import apply_plan
    from shardkit.tools.plan.apply.parallelize_source import parallelize_source
    from shardkit.tools.plan.apply.plan_json import dump_plan

    if how.startswith("source_"):
        name = how.split("_")[1]
        text = parallelize_source(plan, engine=name, model=build() if "model" in how else None)
        namespace: dict[str, Any] = {}
        exec(compile(text, f"<parallelize {how}>", "exec"), namespace)
        namespace["parallelize"](model, mesh)
        return
    if how == "json":
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "plan.json"
            path.write_text(dump_plan(plan))
            apply_plan(model, path, mesh=mesh)
        return
    engine = None if how == "shardkit" else fully_shard
    apply_plan(model, plan, mesh=mesh, fully_shard=engine)


def train_body(
    rank: int, world_size: int, plan_name: str | ShardingPlan, hows: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Runs on every rank: the plan (of ``PLANS``, or given) applied each way in ``hows``
    (``hand`` for its twin in ``BY_HAND``), trained."""
    mesh = init_device_mesh("cpu", (world_size,))
    plan = PLANS[plan_name] if isinstance(plan_name, str) else plan_name
    traces: dict[str, dict[str, Any]] = {}
    for how in hows:
        model = build()
        if how == "hand":
            BY_HAND[str(plan_name)](model, mesh)
        else:
            shard(how, plan, model, mesh)
        traces[how] = train(model, rank, world_size)
        dist.barrier()
    return traces


def assert_bitwise(traces: dict[str, dict[str, Any]], oracle: str = "hand") -> None:
    """Every trace's losses and parameters equal the oracle's bit for bit."""
    expected = traces[oracle]
    for how, trace in traces.items():
        assert trace["losses"] == expected["losses"], (how, trace["losses"], expected["losses"])
        assert trace["wrapped"] == expected["wrapped"], how
        assert trace["params"].keys() == expected["params"].keys(), how
        differs = [
            n for n, v in trace["params"].items() if not torch.equal(v, expected["params"][n])
        ]
        assert differs == [], (how, differs)


def random_plan(seed: int) -> ShardingPlan:
    """A plan for the ``DEPTH``-block GPT drawn from ``seed``: units whole, split or paired,
    embeddings and head in units or left to the root, any reshard, checkpoint and prefetch."""
    rng = random.Random(seed)
    reshard = (True, False, 2)
    units: list[Unit] = []

    def unit(*modules: str) -> None:
        units.append(Unit(modules=modules, reshard_after_forward=rng.choice(reshard)))

    for group in rng.choice(((), (("tok", "pos"),), (("tok",), ("pos",)))):
        unit(*group)
    checkpoint: list[tuple[str, CheckpointMode]] = []
    i = 0
    while i < DEPTH:
        shape = rng.choice(("whole", "parts", "pair") if i + 1 < DEPTH else ("whole", "parts"))
        mode: CheckpointMode = rng.choice(("full", "selective"))
        if shape == "pair":
            unit(f"blocks.{i}", f"blocks.{i + 1}")
            i += 2
            continue
        if shape == "parts":
            unit(f"blocks.{i}.attn")
            unit(f"blocks.{i}.mlp")
        else:
            unit(f"blocks.{i}")
        if rng.random() < 0.5:
            checkpoint.append((f"blocks.{i}" if rng.random() < 0.5 else f"blocks.{i}.mlp", mode))
        i += 1
    for group in rng.choice(((), (("ln_f", "head"),), (("head",),))):
        unit(*group)
    units.append(Unit(modules=(ROOT,), reshard_after_forward=rng.choice((True, False))))
    bf16 = rng.random() < 0.3
    return ShardingPlan(
        units=tuple(units),
        prefetch=rng.choice((1, 2, 3)),
        checkpoint=tuple(checkpoint),
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )


def random_plans_body(rank: int, world_size: int, seeds: list[int]) -> list[dict[str, Any]]:
    """Each seed's plan applied and written out, on both engines, trained: their traces."""
    out = []
    for seed in seeds:
        hows = ("shardkit", "source_shardkit", "torch", "source_torch")
        out.append(train_body(rank, world_size, random_plan(seed), hows))
    return out
