"""LOCAL_STATE_DICT: each FSDP1 unit's ``_flat_param`` shard, as torch's FSDP1 writes it.

A unit's value is a 1-D ShardedTensor of the unit's flat parameter (alignment padding
included, per-rank padding not), this rank holding its slice at ``rank * shard_numel``; a
rank whose slice is all padding holds no shard. Buffers are plain tensors, in their live
dtype. With ``use_orig_params=True`` each parameter is also there under its own name: a
1-D view of its part of this rank's slice. Keys and their order are FSDP1's: a unit's key
comes where its wrapped module's parameters would (``use_orig_params=False``) or after its
whole subtree (``True``), as FSDP1's registered flat parameter or its post-hook puts it.

Saving builds each rank's slice from the engine's per-parameter shards with one all-to-all
per unit (:mod:`shardkit.legacy.flat_exchange`); loading checks every unit's shard on every
rank first (the same error on all ranks, nothing written), then sends the pieces back the
other way and gives the core its DTensors. See [Note: FSDP1 flat parameters].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardkit.legacy.comm import first_error, mesh_ranks_group
from shardkit.legacy.configs import StateDictConfig
from shardkit.legacy.local_units import LocalUnit, local_units
from shardkit.legacy.raw_state import RawState
from shardkit.legacy.sharded_state_dict import as_live
from shardkit.legacy.torch_compat import ShardedTensor, flat_sharded_tensor
from shardkit.legacy.units import unit_of

__all__ = ["HANDLER", "LocalStateDict"]

_FLAT_PARAM = "_flat_param"


class LocalStateDict:
    """The LOCAL_STATE_DICT handler."""

    def consumes(self, key: str) -> bool:
        """Whether ``key`` is a unit's flat parameter (not one of the model's own names)."""
        return key == _FLAT_PARAM or key.endswith("." + _FLAT_PARAM)

    def save(self, wrapper: nn.Module, config: StateDictConfig) -> dict[str, Any]:
        """Clean name -> ShardedTensor (units), tensor (buffers, use_orig_params views)."""
        state = RawState(unit_of(wrapper).module)
        units = local_units(wrapper)
        flats: dict[str, ShardedTensor] = {}
        views: dict[int, torch.Tensor | None] = {}  # id(parameter) -> use_orig_params view
        for unit in units:  # every rank in the same order: one all-to-all each
            shards = [view.local_shard() for view in unit.params]
            flat = unit.exchange.to_flat(shards, unit.group)
            if config.offload_to_cpu:
                flat = flat.cpu()
            for entry, view in zip(unit.layout.params, unit.params, strict=True):
                mine = [p for p in unit.layout.pieces(entry) if p.rank == unit.rank]
                piece = flat[mine[0].start : mine[0].stop] if mine else flat[:0]
                views[id(view.param)] = piece if unit.use_orig_params else None
            # FSDP1's value is a view of its flat parameter, which requires grad.
            flat.requires_grad_(True)
            start = unit.layout.shard_offset(unit.rank)
            flats[unit.key] = flat_sharded_tensor(
                flat, start, unit.layout.numel, unit.rank, unit.group
            )
        return _in_fsdp1_order(state, units, flats, views)

    def to_full(
        self, wrapper: nn.Module, state: RawState, given: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Raw name -> the core's DTensor of each parameter (buffers pass as given).

        Raises:
            ValueError: on every rank alike, before anything moves: a unit's key is missing,
                or its value is not the ShardedTensor this model's layout at this world size
                gives (size, every rank's place, this rank's shard and dtype).
        """
        units = local_units(wrapper)
        try:
            _check_all(units, given)
            mine = None
        except ValueError as error:
            mine = str(error)
        # Agreed among the model's ranks only: on a subgroup the others never call this.
        shared = first_error(mine, mesh_ranks_group(unit_of(wrapper).unit.mesh))
        if shared is not None:
            raise ValueError(shared)
        out: dict[str, Any] = {}
        by_param: dict[int, torch.Tensor] = {}
        for unit in units:
            local = _local_shard(given[unit.key])
            device = unit.params[0].local_shard().device
            flat = local.to(device, unit.layout.dtype) if local is not None else None
            if flat is None:
                flat = torch.empty(0, dtype=unit.layout.dtype, device=device)
            shards = unit.exchange.from_flat(flat, unit.group)
            for view, shard in zip(unit.params, shards, strict=True):
                live = view.param
                by_param[id(live)] = shard.view(view.layout.local_shape(unit.rank))
        for clean, raw in state.raw_of.items():
            live = state.values[raw]
            if id(live) in by_param:
                out[raw] = as_live(clean, by_param[id(live)], live)
            elif clean in given:
                out[raw] = given[clean]
        return out


def _in_fsdp1_order(
    state: RawState,
    units: list[LocalUnit],
    flats: dict[str, ShardedTensor],
    views: dict[int, torch.Tensor | None],
) -> dict[str, Any]:
    """The state dict in FSDP1's key order (see the module's docstring)."""
    keys = list(state.raw_of)
    before: dict[int, list[str]] = {}  # position -> unit keys placed before that key
    after: dict[int, list[str]] = {}  # position -> unit keys placed after it
    for unit in units:  # outermost first: its key precedes those of units inside it
        inside = [i for i, k in enumerate(keys) if unit.in_subtree(k)]
        if not unit.use_orig_params:
            before.setdefault(inside[0] if inside else len(keys), []).append(unit.key)
        else:  # innermost first: a unit's post-hook runs before its parent's
            after.setdefault(inside[-1] if inside else -1, []).insert(0, unit.key)
    out: dict[str, Any] = {}
    for key in after.get(-1, []):
        out[key] = flats[key]
    for index, clean in enumerate(keys):
        for key in before.get(index, []):
            out[key] = flats[key]
        value = state.values[state.raw_of[clean]]
        if id(value) in views:
            view = views[id(value)]  # None: FSDP1 keeps the parameter in the flat one only
            if view is not None:
                out[clean] = view
        else:
            out[clean] = value.detach() if isinstance(value, torch.Tensor) else value
        for key in after.get(index, []):
            out[key] = flats[key]
    for key in before.get(len(keys), []):
        out[key] = flats[key]
    return out


def _describe(unit: LocalUnit) -> str:
    return f"LOCAL_STATE_DICT entry {unit.key} (FSDP1 unit {unit.layout.prefix or '(root)'})"


def _check_all(units: list[LocalUnit], given: Mapping[str, Any]) -> None:
    for unit in units:
        _check(unit, given.get(unit.key))


def _check(unit: LocalUnit, value: object) -> None:
    """That ``value`` is ``unit``'s flat shard at this world size and rank."""
    layout, what = unit.layout, _describe(unit)
    if value is None:
        raise ValueError(f"{what}: missing from the state dict, and the unit has parameters")
    if not isinstance(value, ShardedTensor):
        raise ValueError(f"{what}: a {type(value).__name__}, not FSDP1's ShardedTensor")
    if tuple(value.size()) != (layout.numel,):
        raise ValueError(
            f"{what}: holds {tuple(value.size())} elements, the unit's flat parameter "
            f"{layout.numel} (another model, wrap policy, use_orig_params or mixed precision?)"
        )
    world = layout.world_size
    expected = [
        (layout.shard_offset(r), layout.local_numel(r))
        for r in range(world)
        if layout.local_numel(r)
    ]
    boxes = sorted((m.shard_offsets[0], m.shard_sizes[0]) for m in value.metadata().shards_metadata)
    if boxes != expected:
        raise ValueError(
            f"{what}: its shards lie at (offset, numel) {boxes}; at world size {world} they "
            f"would lie at {expected} (saved at world size {len(boxes)}, or truncated?)"
        )
    local = value.local_shards()
    want = layout.local_numel(unit.rank)
    held = [(s.metadata.shard_offsets[0], s.tensor.numel()) for s in local]
    if held != ([(layout.shard_offset(unit.rank), want)] if want else []):
        raise ValueError(
            f"{what}: rank {unit.rank} holds {held} (offset, numel), it should hold "
            f"{want} elements at {layout.shard_offset(unit.rank)}"
        )
    if local and local[0].tensor.dtype != layout.dtype:
        raise ValueError(
            f"{what}: is {local[0].tensor.dtype}, the unit's parameters are {layout.dtype}"
        )


def _local_shard(value: ShardedTensor) -> torch.Tensor | None:
    shards = value.local_shards()
    return shards[0].tensor.reshape(-1) if shards else None


HANDLER = LocalStateDict()
"""The one instance (stateless)."""
