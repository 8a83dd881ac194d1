"""The sharding plans a user would try on a GPT, for the planner's measurement matrix.

Every plan names modules of :class:`shardkit.tools.plan.gpt.GPT` (``tok``, ``pos``,
``blocks.i`` with ``ln1``, ``attn``, ``ln2``, ``mlp``, ``ln_f``, ``head``); the root is the last
unit and keeps its parameters after forward (fully_shard's default for the root) unless the
plan says otherwise.
"""

from __future__ import annotations

import torch

from shardkit.tools.plan.sharding_plan import ROOT, CheckpointMode, ShardingPlan, Unit

_ROOT_KEEPS = Unit(modules=(ROOT,), reshard_after_forward=False)


def _blocks(n: int) -> list[str]:
    return [f"blocks.{i}" for i in range(n)]


def _per_block(n: int, reshard: bool | int = True) -> tuple[Unit, ...]:
    return (*(Unit(modules=(b,), reshard_after_forward=reshard) for b in _blocks(n)), _ROOT_KEEPS)


def _checkpointed(
    n: int, mode: CheckpointMode, every: int = 1
) -> tuple[tuple[str, CheckpointMode], ...]:
    return tuple((b, mode) for i, b in enumerate(_blocks(n)) if i % every == 0)


def gpt_plans(n_layers: int) -> dict[str, ShardingPlan]:
    """Sixteen plans for a GPT of ``n_layers`` blocks (an even number), by name."""
    blocks = _blocks(n_layers)
    half = n_layers // 2
    pairs = tuple(Unit(modules=(blocks[i], blocks[i + 1])) for i in range(0, n_layers, 2))
    # Each block's attention and MLP a unit, the block one more for its norms (inner first).
    sub_modules = tuple(
        Unit(modules=(name,)) for b in blocks for name in (f"{b}.attn", f"{b}.mlp", b)
    )
    return {
        "per-block": ShardingPlan(units=_per_block(n_layers)),
        "pairs": ShardingPlan(units=(*pairs, _ROOT_KEEPS)),
        "root-only": ShardingPlan(units=(_ROOT_KEEPS,)),
        "sub-modules": ShardingPlan(units=(*sub_modules, _ROOT_KEEPS)),
        "head-apart": ShardingPlan(
            units=(*_per_block(n_layers)[:-1], Unit(modules=("ln_f", "head")), _ROOT_KEEPS)
        ),
        "embed+head-apart": ShardingPlan(
            units=(
                Unit(modules=("tok", "pos")),
                *_per_block(n_layers)[:-1],
                Unit(modules=("ln_f", "head")),
                # The engine needs the root sharded (one root) though it holds no parameter.
                _ROOT_KEEPS,
            )
        ),
        "embed-apart": ShardingPlan(units=(Unit(modules=("tok", "pos")), *_per_block(n_layers))),
        "no-reshard": ShardingPlan(units=(*_per_block(n_layers, reshard=False)[:-1], _ROOT_KEEPS)),
        "no-reshard-last-half": ShardingPlan(
            units=(
                *(Unit(modules=(b,), reshard_after_forward=i < half) for i, b in enumerate(blocks)),
                _ROOT_KEEPS,
            )
        ),
        "prefetch-2": ShardingPlan(units=_per_block(n_layers), prefetch=2),
        "ckpt-full": ShardingPlan(
            units=_per_block(n_layers), checkpoint=_checkpointed(n_layers, "full")
        ),
        "ckpt-every-other": ShardingPlan(
            units=_per_block(n_layers), checkpoint=_checkpointed(n_layers, "full", every=2)
        ),
        "ckpt-selective": ShardingPlan(
            units=_per_block(n_layers), checkpoint=_checkpointed(n_layers, "selective")
        ),
        "bf16": ShardingPlan(
            units=_per_block(n_layers), param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
        "bf16-ckpt-full": ShardingPlan(
            units=_per_block(n_layers),
            checkpoint=_checkpointed(n_layers, "full"),
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
        ),
        "pairs-no-reshard": ShardingPlan(
            units=(
                *(Unit(modules=u.modules, reshard_after_forward=False) for u in pairs),
                _ROOT_KEEPS,
            )
        ),
    }
