"""``state_dict_type``: which form a model's (and its optimizer's) state dict takes.

FSDP1 keeps the type and its configs on every wrapper; setting them sets all the wrappers of
a model, and reading them checks that they agree. Torch's own configs are accepted too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from torch import nn

from shardkit.legacy import configs
from shardkit.legacy.configs import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shardkit.legacy.local_units import DEVICE_MESH_REFUSED
from shardkit.legacy.torch_compat import translate
from shardkit.legacy.units import unit_of, units_in

__all__ = [
    "SUPPORTED",
    "get_state_dict_type",
    "set_state_dict_type",
    "state_dict_type",
]

_OURS = {name: getattr(configs, name) for name in configs.__all__}

_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}

SUPPORTED = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
)
"""The types this package implements: all of FSDP1's."""


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state-dict type and configs of every wrapper in ``module``'s tree.

    Returns:
        The settings they had before.

    Raises:
        RuntimeError: a config of another type than ``state_dict_type`` takes (as FSDP1).
    """
    warnings.warn(
        "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated. Please "
        "use APIs, get_state_dict() and set_state_dict(), which can support different "
        "parallelisms, FSDP1, FSDP2, DDP.",
        FutureWarning,
        stacklevel=2,
    )
    kind = translate(state_dict_type, _OURS)
    if kind not in SUPPORTED:
        raise ValueError(f"{state_dict_type!r} is not a StateDictType")
    config_type, optim_config_type = _CONFIGS[kind]
    config = translate(state_dict_config, _OURS) or config_type()
    optim_config = translate(optim_state_dict_config, _OURS) or optim_config_type()
    for given, wanted in ((config, config_type), (optim_config, optim_config_type)):
        if type(given) is not wanted:
            raise RuntimeError(
                f"Expected state_dict_config of type {wanted} but got {type(given)}"
                if wanted is config_type
                else f"Expected optim_state_dict_config of type {wanted} but got {type(given)}"
            )
    wrappers = units_in(module)
    previous = _agreed(module, wrappers) if wrappers else None
    for wrapper in wrappers:
        unit_of(wrapper).settings = StateDictSettings(kind, config, optim_config)
    if previous is None:
        return StateDictSettings(kind, config, optim_config)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state-dict settings of the wrappers in ``module``'s tree.

    Raises:
        ValueError: ``module`` holds no FullyShardedDataParallel.
        AssertionError: its wrappers disagree (FSDP1's error).
        RuntimeError: LOCAL_STATE_DICT on wrappers built with ``device_mesh`` (as FSDP1,
            whose optimizer-state APIs read the settings here).
    """
    wrappers = units_in(module)
    if not wrappers:
        raise ValueError(f"{type(module).__name__} holds no FullyShardedDataParallel")
    agreed = _agreed(module, wrappers)
    if agreed.state_dict_type is StateDictType.LOCAL_STATE_DICT and any(
        unit_of(w).unit.device_mesh_given for w in wrappers
    ):
        raise RuntimeError(DEVICE_MESH_REFUSED)
    return agreed


def _agreed(module: nn.Module, wrappers: list[nn.Module]) -> StateDictSettings:
    first = unit_of(wrappers[0]).settings
    for wrapper in wrappers[1:]:
        if unit_of(wrapper).settings != first:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings. Got "
                f"{unit_of(wrapper).settings} and {first} in {type(module).__name__}."
            )
    return first


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """``set_state_dict_type`` for the context; the previous settings come back after."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        for wrapper in units_in(module):
            unit_of(wrapper).settings = previous
