"""FSDP1's optimizer-state static methods (filled in by a later commit)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


def _todo(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("optimizer state dicts are not implemented yet")


optim_state_dict = optim_state_dict_to_load = full_optim_state_dict = _todo
sharded_optim_state_dict = shard_full_optim_state_dict = _todo
flatten_sharded_optim_state_dict = scatter_full_optim_state_dict = rekey_optim_state_dict = _todo
