"""The configurations the search compares: sharding plans built from a model's structure.

A user choosing by hand tries a handful of shapes: every block a unit, two blocks to a unit,
a block's large sub-modules (attention, MLP) as units of their own, the embeddings and the
output head apart from the root or kept with it; then, per unit, whether full parameters
are kept from forward to backward, how far ahead units are gathered, and which blocks
recompute their activations. :func:`model_shape` reads what those choices are made of from
the model (its blocks, the modules before and after them, each block's large children),
and :func:`sharding_plan` writes one choice of each as a :class:`ShardingPlan`. Which
combinations are worth predicting is the search's business (``search``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from shardkit.core import ReducePrecision
from shardkit.tools.plan.groups import select_group_modules
from shardkit.tools.plan.sharding_plan import ROOT, CheckpointMode, ShardingPlan, Unit

__all__ = [
    "Boundary",
    "Choice",
    "ModelShape",
    "Precision",
    "model_shape",
    "sharding_plan",
]

Boundary = Literal["block", "pair", "sub"]
"""Where units end: each block; each pair of consecutive blocks; each block's large children
(attention, MLP) with the block itself holding the rest (its norms)."""

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

SUB_MODULE_SHARE = 0.1
"""A block's child with at least this share of the block's parameters is a unit of its own
under the ``sub`` boundary; smaller ones (norms, biases) stay with the block, whose own unit
would otherwise be a gather of a few kilobytes."""


@dataclass(frozen=True, slots=True)
class Precision:
    """Mixed precision and the reduction's wire format, as one choice."""

    param_dtype: torch.dtype | None = None
    """The gathered parameters' dtype, or None (the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """The reduction's dtype, or None."""
    reduce_precision: ReducePrecision | None = None
    """How gradients travel on the wire (shardkit's engine), or None."""

    def describe(self) -> str:
        """``bf16/fp32`` style: the gathered and reduced dtypes, and the wire's."""

        def name(dtype: torch.dtype | None) -> str:
            return _SHORT.get(dtype, str(dtype).removeprefix("torch.")) if dtype else "own"

        text = f"{name(self.param_dtype)}/{name(self.reduce_dtype)}"
        if self.reduce_precision is not None and self.reduce_precision.wire_dtype is not None:
            wire = self.reduce_precision.wire_dtype
            text += f" wire {wire if isinstance(wire, str) else name(wire)}"
        return text


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model's sharding choices are made of, by FQN."""

    blocks: tuple[str, ...]
    """The repeated blocks (elements of the outermost ``nn.ModuleList``s), in forward order."""
    leading: tuple[str, ...]
    """The root's children with parameters registered before the blocks (embeddings)."""
    trailing: tuple[str, ...]
    """Those registered after them (the final norm, the output head)."""
    sub_modules: dict[str, tuple[str, ...]]
    """Block FQN -> its children large enough to be units of their own (``SUB_MODULE_SHARE``)."""
    block_keeps_params: dict[str, bool]
    """Block FQN -> whether parameters are left in the block once its large children are
    units (then the block is a unit too)."""
    edges_share_params: bool
    """Whether a leading and a trailing module share a parameter (tied embeddings): they then
    form one unit, since one parameter cannot be in two."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One point of the search space; :func:`sharding_plan` turns it into a plan."""

    boundary: Boundary = "block"
    edges_apart: bool = False
    """The leading and trailing modules as units of their own, not in the root's."""
    keep_last: int = 0
    """How many of the last blocks' units keep full parameters from forward to backward
    (``reshard_after_forward=False``): backward needs them first, so keeping them costs the
    shortest hold for a saved all-gather each."""
    reshard_slice: int | None = None
    """The other units keep a 1/n slice after forward (``reshard_after_forward=n``) instead of
    freeing everything: the gather in backward then stays within n ranks (a node)."""
    prefetch: int = 1
    checkpoint_every: int = 0
    """Recompute every n-th block's activations (1: every block; 0: none)."""
    checkpoint_mode: CheckpointMode = "full"
    offload: bool = False
    precision: Precision = Precision()

    def describe(self) -> str:
        """A short line naming the choice, as reports show it."""
        parts = [
            {"block": "per block", "pair": "per 2 blocks", "sub": "per sub-module"}[self.boundary],
            "edges apart" if self.edges_apart else "edges in root",
        ]
        if self.keep_last:
            parts.append(f"keep last {self.keep_last}")
        if self.reshard_slice:
            parts.append(f"reshard to 1/{self.reshard_slice}")
        if self.prefetch > 1:
            parts.append(f"prefetch {self.prefetch}")
        if self.checkpoint_every:
            every = "" if self.checkpoint_every == 1 else f" every {self.checkpoint_every}"
            parts.append(f"AC {self.checkpoint_mode}{every}")
        if self.offload:
            parts.append("offload")
        if self.precision != Precision():
            parts.append(self.precision.describe())
        return ", ".join(parts)


def model_shape(model: nn.Module) -> ModelShape:
    """Blocks, edge modules and large sub-modules of ``model``, by FQN.

    Raises:
        ValueError: the model has no ``nn.ModuleList`` of blocks to shard one by one.
    """
    blocks = [name for name, _ in select_group_modules(model, None) if name]
    if not blocks:
        raise ValueError(
            f"shardkit.tools.plan: {type(model).__name__} has no nn.ModuleList of blocks; the "
            "search chooses among unit boundaries of repeated blocks"
        )
    top = {name.split(".", 1)[0] for name in blocks}
    leading: list[str] = []
    trailing: list[str] = []
    seen_blocks = False
    for name, child in model.named_children():
        if name in top:
            seen_blocks = True
            continue
        if any(True for _ in child.parameters()):
            (trailing if seen_blocks else leading).append(name)
    modules = dict(model.named_modules())
    sub_modules: dict[str, tuple[str, ...]] = {}
    keeps: dict[str, bool] = {}
    for block in blocks:
        module = modules[block]
        total = sum(p.numel() for p in module.parameters())
        large = tuple(
            f"{block}.{name}"
            for name, child in module.named_children()
            if sum(p.numel() for p in child.parameters()) >= SUB_MODULE_SHARE * total
            and type(child).forward is not nn.Module.forward
        )
        sub_modules[block] = large
        inside = {id(p) for name in large for p in modules[name].parameters()}
        keeps[block] = any(id(p) not in inside for p in module.parameters())
    lead_params = {id(p) for n in leading for p in modules[n].parameters()}
    shared = any(id(p) in lead_params for n in trailing for p in modules[n].parameters())
    return ModelShape(
        blocks=tuple(blocks),
        leading=tuple(leading),
        trailing=tuple(trailing),
        sub_modules=sub_modules,
        block_keeps_params=keeps,
        edges_share_params=shared,
    )


def sharding_plan(shape: ModelShape, choice: Choice) -> ShardingPlan:
    """The plan ``choice`` describes for a model of ``shape``."""
    block_units = _block_units(shape, choice.boundary)
    kept = _kept_blocks(shape.blocks, choice.keep_last)
    default: bool | int = choice.reshard_slice if choice.reshard_slice else True
    units = [
        Unit(modules=modules, reshard_after_forward=False if kept & set(owners) else default)
        for modules, owners in block_units
    ]
    if choice.edges_apart:
        # In forward order, so that prefetch lists (which follow the units' order) do: the
        # leading modules first, the trailing ones after the blocks. Those run last in forward
        # and first in backward: like the last blocks, freeing them after forward buys
        # nothing. Tied edges share a parameter, so they are one unit, run first and kept.
        if shape.edges_share_params:
            tied = (*shape.leading, *shape.trailing)
            units.insert(0, Unit(modules=tied, reshard_after_forward=False))
        else:
            if shape.leading:
                units.insert(0, Unit(modules=shape.leading, reshard_after_forward=True))
            if shape.trailing:
                units.append(Unit(modules=shape.trailing, reshard_after_forward=False))
    units.append(Unit(modules=(ROOT,), reshard_after_forward=False))
    every = choice.checkpoint_every
    checkpoint = tuple(
        (module, choice.checkpoint_mode)
        for i, block in enumerate(shape.blocks)
        if every and i % every == 0
        for module in _recomputed(shape, block, choice.boundary)
    )
    precision = choice.precision
    return ShardingPlan(
        units=tuple(units),
        prefetch=choice.prefetch,
        checkpoint=checkpoint,
        offload=choice.offload,
        param_dtype=precision.param_dtype,
        reduce_dtype=precision.reduce_dtype,
        reduce_precision=precision.reduce_precision,
    )


def _block_units(
    shape: ModelShape, boundary: Boundary
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(modules of a unit, the blocks it belongs to), in ``fully_shard`` order."""
    blocks = shape.blocks
    if boundary == "block":
        return [((b,), (b,)) for b in blocks]
    if boundary == "pair":
        return [
            (tuple(blocks[i : i + 2]), tuple(blocks[i : i + 2])) for i in range(0, len(blocks), 2)
        ]
    units: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for block in blocks:
        units.extend(((sub,), (block,)) for sub in shape.sub_modules[block])
        if shape.block_keeps_params[block] or not shape.sub_modules[block]:
            units.append(((block,), (block,)))
    return units


def _recomputed(shape: ModelShape, block: str, boundary: Boundary) -> tuple[str, ...]:
    """What recomputes for ``block``: the block, or under ``sub`` its large children.

    Those children are units: a checkpointed block would rerun their gathers' hooks in its
    recomputation, which the planner does not model.
    """
    if boundary == "sub" and shape.sub_modules[block]:
        return shape.sub_modules[block]
    return (block,)


def _kept_blocks(blocks: Sequence[str], keep_last: int) -> set[str]:
    return set(blocks[len(blocks) - keep_last :]) if keep_last > 0 else set()
