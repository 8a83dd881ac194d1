"""Model state dicts: one handler per ``StateDictType``, chosen by the wrapper's settings.

A wrapper answers ``state_dict()`` for its whole subtree: the handler reads the wrapped
module's raw state (where inner wrappers still show as ``_fsdp_wrapped_module``) under
:func:`plain_state_dicts`, and returns it under FSDP1's clean names. Loading maps the clean
names back and lets the core load, all keys checked before anything is written.

LOCAL_STATE_DICT's values are keyed by unit (``<unit>._flat_param``), not by parameter:
its handler says which given keys it reads besides the model's own (``consumes``).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from shardkit.legacy import full_state_dict, local_state_dict, sharded_state_dict
from shardkit.legacy.configs import (
    FullStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from shardkit.legacy.flat_params import flat_of, per_parameter_view
from shardkit.legacy.raw_state import PLAIN, RawState, plain_state_dicts, raw_state
from shardkit.legacy.torch_compat import FSDP_PREFIX, clean_name, renamed_keys
from shardkit.legacy.units import unit_of, units_in

__all__ = [
    "HANDLERS",
    "StateDictHandler",
    "load_from_parent",
    "load_state_dict",
    "settle_parent_load",
    "state_dict",
]

# By wrapper: the raw keys of the flat parameters its load_from_parent loaded, for its
# settle_parent_load at the end of the same walk.
_FLATS_LOADED: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()
# The wrappers inside one whose load_from_parent loaded them, until the walk reaches them.
_LOADED_BY_OUTER: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class StateDictHandler(Protocol):
    """One state-dict type: saving and loading a wrapper's subtree."""

    def save(self, wrapper: nn.Module, config: StateDictConfig) -> dict[str, Any]:
        """Clean name -> value, in state-dict order."""

    def consumes(self, key: str) -> bool:
        """Whether the given ``key``, not one of the model's names, is the handler's to read."""

    def to_full(
        self, wrapper: nn.Module, state: RawState, given: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Raw name -> value the core loads (its DTensors, or full tensors)."""


HANDLERS: dict[StateDictType, StateDictHandler] = {
    StateDictType.FULL_STATE_DICT: full_state_dict.HANDLER,
    StateDictType.SHARDED_STATE_DICT: sharded_state_dict.HANDLER,
    StateDictType.LOCAL_STATE_DICT: local_state_dict.HANDLER,
}


def _handler(wrapper: nn.Module) -> tuple[StateDictHandler, StateDictConfig]:
    state = unit_of(wrapper)
    settings = state.settings
    if state.unit.strategy is ShardingStrategy.NO_SHARD:
        # As FSDP1: a NO_SHARD unit always gives a FULL state dict, with the default config
        # (every rank, no offload), whatever was set, and says so.
        warnings.warn(
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
            stacklevel=4,
        )
        return HANDLERS[StateDictType.FULL_STATE_DICT], FullStateDictConfig()
    return HANDLERS[settings.state_dict_type], settings.state_dict_config


def state_dict(wrapper: nn.Module, plain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``wrapper.state_dict(...)``: FSDP1's form for the type set on it."""
    if PLAIN.get():
        return plain(wrapper, *args, **kwargs)
    destination = kwargs.pop("destination", args[0] if args else None)
    prefix = kwargs.pop("prefix", args[1] if len(args) > 1 else "")
    if destination is None:
        destination = OrderedDict()
    handler, config = _handler(wrapper)
    with per_parameter_view():  # the originals, not flat parameters, are what is saved
        saved = handler.save(wrapper, config)
    for key, value in saved.items():
        destination[prefix + key] = value
    return destination


def load_state_dict(
    wrapper: nn.Module, given: Mapping[str, Any], *, strict: bool, assign: bool
) -> Any:
    """``wrapper.load_state_dict(...)``: every key checked first, then loaded by the core.

    Returns:
        ``nn.Module``'s missing and unexpected keys, under clean names.
    """
    with per_parameter_view():  # the originals, not flat parameters, are what is loaded
        return _load_state_dict(wrapper, given, strict=strict, assign=assign)


def _load_state_dict(
    wrapper: nn.Module, given: Mapping[str, Any], *, strict: bool, assign: bool
) -> Any:
    handler, _ = _handler(wrapper)
    state = raw_state(wrapper)
    converted = handler.to_full(wrapper, state, given)
    for key, value in given.items():
        if key not in state.raw_of and not handler.consumes(key):
            converted[key] = value  # unexpected: the core reports it (strict)
    for raw, dtype in state.buffer_dtypes.items():
        live = state.values[raw]
        if raw in converted and isinstance(converted[raw], torch.Tensor) and dtype != live.dtype:
            converted[raw] = converted[raw].to(live.dtype)  # trained in buffer_dtype
    with plain_state_dicts():
        result = unit_of(wrapper).module.load_state_dict(converted, strict=strict, assign=assign)
    return renamed_keys(result, clean_name)


def load_from_parent(
    wrapper: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook: a wrapper's part of a plain parent's ``load_state_dict``.

    A model whose root is not a wrapper (a container of wrapped blocks) is loaded by
    ``nn.Module``, which walks into each wrapper's raw names (``_fsdp_wrapped_module``) and
    copies values into its parameters. The hook loads the wrapper's subtree from FSDP1's
    clean keys first, as the wrapper's own ``load_state_dict`` would (all checked, then
    loaded; every state-dict type), then hands ``nn.Module`` the live values under the raw
    names, so its walk copies each onto itself. Flat parameters are the exception: the walk
    reports them missing and :func:`settle_parent_load` takes them off the list. Keys the
    subtree lacks are reported missing under their clean names; unexpected ones stay
    unexpected.
    """
    del strict, error_msgs
    inner = prefix + FSDP_PREFIX
    if wrapper in _LOADED_BY_OUTER:
        _LOADED_BY_OUTER.discard(wrapper)  # once: the mark is for this walk only
        return  # an outer wrapper's hook loaded this subtree
    if PLAIN.get() or any(k.startswith(inner) for k in state_dict):
        return  # a wrapper's own load, or an outer wrapper's hook, has this subtree
    given = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    try:
        result = load_state_dict(wrapper, given, strict=False, assign=assign)
    except ValueError as error:  # name the wrapper as the parent's state dict does
        raise ValueError(f"loading {prefix[:-1]!r}: {error}") from error
    for key in set(given) - set(result.unexpected_keys):
        del state_dict[prefix + key]
    # As registered now (flat parameters, not the originals, unless listed again).
    with plain_state_dicts():
        registered = unit_of(wrapper).module.state_dict(keep_vars=True)
    for raw, value in registered.items():
        # Flat parameters are not handed on: a wrapper in between may move their keys
        # (checkpoint_wrapper's load hook puts all its keys under `_checkpoint_wrapped_module.`,
        # where a flat parameter registered on the wrapper itself is not). Loaded above.
        if flat_of(value) is None:
            state_dict[inner + raw] = value
    # Where the walk will miss them: the modules' own paths (no state-dict hook renames them).
    _FLATS_LOADED[wrapper] = [
        inner + name
        for name, param in unit_of(wrapper).module.named_parameters()
        if flat_of(param) is not None
    ]
    # The walk reaches the inner wrappers next: they may see none of their keys (a unit
    # holding only its flat parameter), so they are told this subtree is loaded.
    _LOADED_BY_OUTER.update(units_in(unit_of(wrapper).module))
    missing_keys.extend(prefix + key for key in result.missing_keys)


def settle_parent_load(wrapper: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post-hook: flat parameters are not missing after a parent's load.

    :func:`load_from_parent` loaded them and handed ``nn.Module``'s walk no value under
    their raw names, which it then reports missing.
    """
    flats = set(_FLATS_LOADED.pop(wrapper, ()))
    if flats:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in flats]
