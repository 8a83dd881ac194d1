"""SHARDED_STATE_DICT: each parameter's shard, in the form FSDP1 gives it.

Without a device mesh a parameter is a ShardedTensor of its dim-0 chunks over the group it
is sharded on, this rank holding its own (torch.chunk's cut, which is the core's too); with
a device mesh (or ``_use_dtensor``) it is a DTensor, ``Shard(0)`` on the shard axis. Buffers
are plain tensors. DCP saves, loads and reshards both. Loading takes either form, or full
tensors, and gives each rank's shard to the core.

The ShardedTensors are built by ``shardkit.tp.DTensorExtensions.chunk_tensor``, FSDP1's
extension hook, from full tensors gathered one group at a time. A 2D (FSDP x TP) model's
values are its ``chunk_dtensor``'s, as FSDP1's are: DTensors on the whole (dp, tp) mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardkit.core import iter_full_state_dict
from shardkit.legacy.comm import first_error, mesh_ranks_group
from shardkit.legacy.configs import StateDictConfig
from shardkit.legacy.raw_state import RawState, plain_state_dicts
from shardkit.legacy.torch_compat import ShardedTensor
from shardkit.legacy.units import unit_of
from shardkit.tp import DTensorExtensions

__all__ = [
    "HANDLER",
    "ShardedStateDict",
    "as_live",
    "check_chunk",
    "chunk_2d",
    "chunk_like",
    "chunk_replicated",
    "gather_chunks",
    "is_chunked_whole",
    "is_sharded",
    "local_of_loaded",
    "placed_as",
]

_EXTENSIONS = DTensorExtensions()


def chunk_like(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """``full`` as FSDP1's ShardedTensor over the shard axis of ``like``'s mesh."""
    mesh = like.device_mesh
    axis = mesh.ndim - 1
    group = mesh.get_group(axis)
    return _EXTENSIONS.chunk_tensor(
        full,
        mesh.get_local_rank(axis),
        mesh.size(axis),
        _devices_per_node(full.device),
        group,
        device=full.device,
    )


def chunk_replicated(full: torch.Tensor, like: DTensor, *, as_dtensor: bool) -> torch.Tensor:
    """``full`` as FSDP1 saves a ``NO_SHARD`` unit's optimizer state: cut over its replicas.

    FSDP1's SHARDED (and LOCAL) optimizer state dicts cut every state tensor on dim 0 across
    the unit's process group, ``NO_SHARD``'s too, whose ranks all hold it whole: a ShardedTensor,
    or with a device mesh a ``Shard(0)`` DTensor on it. ``like`` is on the unit's (W, 1) mesh.
    """
    mesh = like.device_mesh
    if as_dtensor:
        names = mesh.mesh_dim_names
        assert names is not None, "a NO_SHARD unit's mesh has axis names"
        return distribute_tensor(full, mesh[names[0]], [Shard(0)], src_data_rank=None)
    return _EXTENSIONS.chunk_tensor(
        full,
        mesh.get_local_rank(0),
        mesh.size(0),
        _devices_per_node(full.device),
        mesh.get_group(0),
        device=full.device,
    )


def is_sharded(value: object) -> bool:
    """Whether ``value`` is a DTensor that ranks hold parts of (sharded on an axis of 2+)."""
    return isinstance(value, DTensor) and any(
        p.is_shard() and value.device_mesh.size(axis) > 1 for axis, p in enumerate(value.placements)
    )


def is_chunked_whole(value: ShardedTensor, like: torch.Tensor) -> bool:
    """Whether ``value`` is a replicated parameter's state cut into chunks (FSDP1's NO_SHARD).

    ``like`` is the parameter: a DTensor that no rank holds a part of (every rank holds it
    whole), while ``value`` has more than one shard. The shards are global metadata, so every
    rank decides alike.
    """
    if not isinstance(like, DTensor) or is_sharded(like):
        return False
    return len(value.metadata().shards_metadata) > 1


def check_chunk(value: ShardedTensor, like: DTensor, what: str) -> None:
    """Raise unless ``value`` holds this rank's torch.chunk cut of a tensor shaped as ``like``.

    Raises:
        ValueError: another global shape, or another cut (saved on another number of ranks).
    """
    if tuple(value.size()) != tuple(like.shape):
        raise ValueError(
            f"{what}: a tensor of shape {tuple(value.size())}, the parameter's is "
            f"{tuple(like.shape)}"
        )
    mesh = like.device_mesh
    rank, size, rows = mesh.get_local_rank(0), mesh.size(0), like.shape[0]
    step = -(-rows // size)
    expected = (max(0, min(step, rows - rank * step)), *like.shape[1:])
    local = tuple(local_of_loaded(value, like).shape)
    if local != expected:
        raise ValueError(
            f"{what}: this rank's chunk has shape {local}, a cut over the unit's {size} "
            f"ranks gives it {expected} (saved on another number of ranks?)"
        )


def gather_chunks(value: ShardedTensor, like: DTensor) -> torch.Tensor:
    """The whole of a chunked ShardedTensor (see :func:`is_chunked_whole`), on every rank.

    Every rank of ``like``'s replicas calls it: one all-gather of dim-0 chunks, each padded to
    torch.chunk's size, over the first axis of ``like``'s mesh.
    """
    mesh = like.device_mesh
    group = mesh.get_group(0)
    size, rows = mesh.size(0), value.size(0)
    step = -(-rows // size)  # torch.chunk's cut: ceil(rows / size) rows each, the last fewer
    local = local_of_loaded(value, like).to(like.to_local().device, like.dtype)
    padded = local.new_zeros((step, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = local.new_empty((step * size, *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered[:rows]


def chunk_2d(full: torch.Tensor, like: DTensor, dp_mesh: DeviceMesh) -> DTensor:
    """``full`` as FSDP1's value for a 2D (FSDP x TP) model: its extension's DTensor.

    A tensor-parallel parameter (``like`` on the (dp, tp) mesh) goes to its TP layout first,
    then ``chunk_dtensor`` shards its TP part on dp; another parameter goes as it is.
    """
    mesh = like.device_mesh
    if mesh.ndim > dp_mesh.ndim:
        names = mesh.mesh_dim_names
        assert names is not None, "a (dp, tp) mesh has axis names"
        tp = distribute_tensor(full, mesh[names[-1]], [like.placements[-1]], src_data_rank=None)
        return _EXTENSIONS.chunk_dtensor(tp, 0, dp_mesh)
    return _EXTENSIONS.chunk_dtensor(full, 0, dp_mesh)


def _devices_per_node(device: torch.device) -> int:
    return 1 if device.type == "cpu" else max(1, torch.accelerator.device_count())


class ShardedStateDict:
    """The SHARDED_STATE_DICT handler."""

    def save(self, wrapper: nn.Module, config: StateDictConfig) -> dict[str, Any]:
        """Clean name -> ShardedTensor or DTensor (parameters), tensor (buffers)."""
        state_of = unit_of(wrapper)
        module = state_of.module
        state = RawState(module)
        use_dtensor = bool(getattr(config, "_use_dtensor", False))
        use_dtensor = use_dtensor or state_of.unit.device_mesh_given
        found: dict[str, Any] = {}
        two_d = state_of.unit.two_d
        if use_dtensor and not two_d:
            for key, value in state.values.items():
                if isinstance(value, DTensor):
                    found[key] = value.detach()  # already FSDP1's DTensor: Shard(0) on dp
        with plain_state_dicts():
            for key, full in iter_full_state_dict(module, rank0_only=False, cpu_offload=False):
                value = state.values[key]
                if isinstance(value, DTensor):
                    if two_d:
                        found[key] = chunk_2d(full, value, state_of.unit.mesh)
                    elif not use_dtensor:
                        found[key] = chunk_like(full, value)
                    continue
                dtype = state.buffer_dtypes.get(key)
                found[key] = full.to(dtype) if dtype is not None else full
        if config.offload_to_cpu:
            found = {k: v.cpu() for k, v in found.items()}
        return {clean: found[raw] for clean, raw in state.raw_of.items() if raw in found}

    def consumes(self, key: str) -> bool:
        """No key besides the model's own."""
        return False

    def to_full(
        self, wrapper: nn.Module, state: RawState, given: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Raw name -> the core's DTensor for each loaded shard (full tensors pass).

        Raises:
            ValueError: on every rank of the model alike, before anything is written: a
                loaded shard does not have this rank's shape on some rank.
        """
        out: dict[str, Any] = {}
        problems: list[str] = []
        for clean, value in given.items():
            raw = state.raw_of.get(clean)
            if raw is None:
                continue
            live = state.values[raw]
            if isinstance(value, ShardedTensor) and isinstance(live, DTensor):
                try:
                    value = as_live(clean, local_of_loaded(value, live), live)
                except ValueError as error:
                    # Go on through every key: the other ranks' values in another layout
                    # gather below, and this rank must take part before it raises.
                    problems.append(str(error))
                    continue
            elif (
                isinstance(value, DTensor)
                and isinstance(live, DTensor)
                and (value.placements != live.placements or value.device_mesh != live.device_mesh)
            ):
                value = value.full_tensor()  # another layout: the core takes its shard
            out[raw] = value
        # A shard bad on one rank only: every rank of the model refuses, none loads.
        # See [Note: agreed loads].
        mine = "; ".join(problems) + "; nothing was loaded" if problems else None
        shared = first_error(mine, mesh_ranks_group(unit_of(wrapper).unit.mesh))
        if shared is not None:
            raise ValueError(shared)
        return out


def local_of_loaded(value: ShardedTensor, like: DTensor) -> torch.Tensor:
    """This rank's chunk in a loaded ShardedTensor (empty where the rank holds none)."""
    _, shards = _EXTENSIONS.pre_load_state_dict_transform(value)
    if shards:
        local: torch.Tensor = shards[0].tensor
        return local
    shape = (0, *like.shape[1:])
    return torch.empty(shape, dtype=like.dtype, device=like.to_local().device)


def as_live(key: str, local: torch.Tensor, live: DTensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out as the parameter ``live``.

    Raises:
        ValueError: ``local`` does not have this rank's shard shape.
    """
    expected = live.to_local().shape
    if local.shape != expected:
        raise ValueError(
            f"SHARDED_STATE_DICT entry {key}: this rank's shard has shape {tuple(local.shape)}, "
            f"the parameter's is {tuple(expected)} (saved on another number of ranks? load "
            "through torch.distributed.checkpoint, which reshards)"
        )
    return placed_as(live, local.to(live.to_local().device, live.dtype))


def placed_as(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor around ``local`` (this rank's part), placed and shaped as ``like``."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


HANDLER = ShardedStateDict()
"""The one instance (stateless)."""
