"""FULL_STATE_DICT: every parameter and buffer as a full tensor, under FSDP1's names.

The values come from the core's generator, one group at a time, so no rank ever holds more
than the state dict plus one group's full parameters: the same bound as the core's file
writer. ``rank0_only`` leaves the other ranks with an empty dict, ``offload_to_cpu`` gives
CPU tensors (also on CPU-only machines, where FSDP1 fails). Buffers trained in a mixed
precision ``buffer_dtype`` come back in their own dtype. Loading takes full tensors on every
rank; each keeps its shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.core import iter_full_state_dict
from shardkit.legacy.configs import StateDictConfig
from shardkit.legacy.raw_state import RawState, plain_state_dicts
from shardkit.legacy.units import unit_of

__all__ = ["HANDLER", "FullStateDict"]


class FullStateDict:
    """The FULL_STATE_DICT handler."""

    def save(self, wrapper: nn.Module, config: StateDictConfig) -> dict[str, Any]:
        """Clean name -> full tensor (on the coordinator only with ``rank0_only``)."""
        unit = unit_of(wrapper)
        module = unit.module
        state = RawState(module)
        live = _storages(state.values.values())
        rank0_only = bool(getattr(config, "rank0_only", False))
        # FSDP1's "rank 0" is the first rank of the shard group: with a replicate axis (HSDP)
        # the first rank of every replica receives, so every rank gathers.
        replicated = unit.unit.mesh.ndim > 1
        if rank0_only and replicated and unit.unit.process_group.rank() != 0:
            with plain_state_dicts():
                for _ in iter_full_state_dict(module, rank0_only=False, cpu_offload=False):
                    pass  # take part in the gathers, keep nothing
            return {}
        found: dict[str, torch.Tensor] = {}
        with plain_state_dicts():
            for key, value in iter_full_state_dict(
                module,
                rank0_only=rank0_only and not replicated,
                cpu_offload=config.offload_to_cpu,
            ):
                if _is_managed(state, key) and _storage_of(value) in live:
                    value = value.clone()  # a one-rank group's shard is the tensor itself
                dtype = state.buffer_dtypes.get(key)
                found[key] = value.to(dtype) if dtype is not None else value
        return {clean: found[raw] for clean, raw in state.raw_of.items() if raw in found}

    def consumes(self, key: str) -> bool:
        """No key besides the model's own."""
        return False

    def to_full(
        self, wrapper: nn.Module, state: RawState, given: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Raw name -> the given full tensor (the core takes each rank's shard)."""
        return {state.raw_of[k]: v for k, v in given.items() if k in state.raw_of}


def _is_managed(state: RawState, key: str) -> bool:
    # Ignored parameters stay the module's plain tensors; FSDP1 gives those, uncopied.
    return key in state.params and isinstance(state.values.get(key), DTensor)


def _storage_of(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.untyped_storage().data_ptr())


def _storages(values: Any) -> set[int]:
    return {_storage_of(v) for v in values if isinstance(v, torch.Tensor) and not v.is_meta}


HANDLER = FullStateDict()
"""The one instance (stateless)."""
