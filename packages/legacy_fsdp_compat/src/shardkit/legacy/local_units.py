"""The FSDP1 units of a live wrapper tree, as LOCAL_STATE_DICT sees them.

Each wrapper with parameters is one FSDP1 flat parameter: its layout comes from the wrapped
module's own parameters, in FSDP1's order, through :func:`unit_flat_layout`, and each of its
parameters is matched (by identity) with the engine's sharded parameter in the core's
layout view. Nothing here communicates or changes the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from shardkit.core.layout import ShardedParamView, layout_of
from shardkit.legacy.flat_exchange import FlatExchange, ParamSpan
from shardkit.legacy.flat_layout import FlatParamUnit, unit_flat_layout
from shardkit.legacy.torch_compat import clean_name
from shardkit.legacy.units import UnitState, unit_of, units_in

__all__ = ["DEVICE_MESH_REFUSED", "LocalUnit", "local_units"]

DEVICE_MESH_REFUSED = (
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
    "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get DTensor "
    "state_dict."
)
"""FSDP1's error for LOCAL_STATE_DICT on a wrapper built with ``device_mesh``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalUnit:
    """One wrapper with parameters: its flat layout, the engine's parameters, its group."""

    layout: FlatParamUnit
    """Its FSDP1 flat parameter; ``layout.prefix`` is its clean name from the wrapper whose
    state dict is taken."""
    params: tuple[ShardedParamView, ...]
    """The engine's parameter of each entry of ``layout``, in its order."""
    exchange: FlatExchange
    group: dist.ProcessGroup
    """The process group FSDP1 shards the unit over (the shard group)."""
    use_orig_params: bool
    """FSDP1's ``use_orig_params``: each parameter's own name is in the state dict too."""

    @property
    def key(self) -> str:
        """Its key in the state dict (``blocks.0._flat_param``)."""
        return self.layout.state_dict_key

    @property
    def rank(self) -> int:
        """This rank's index in ``group``."""
        return self.exchange.rank

    def owns(self, value: object) -> int | None:
        """The index of the entry whose parameter ``value`` is (None: not this unit's)."""
        for index, view in enumerate(self.params):
            if view.param is value:
                return index
        return None

    def in_subtree(self, key: str) -> bool:
        """Whether the clean state-dict ``key`` lies under the unit's module."""
        prefix = self.layout.prefix
        return not prefix or key.startswith(prefix + ".")


def local_units(wrapper: nn.Module) -> list[LocalUnit]:
    """The units of ``wrapper``'s tree with parameters, outermost first (every rank alike).

    A wrapper reached under several names (a module shared by two attributes) is a unit
    under each of them, as FSDP1's state dict walks every name.

    Raises:
        RuntimeError: a wrapper was built with ``device_mesh`` (FSDP1's own error).
        ValueError: a unit's parameters have several dtypes (FSDP1 cannot flatten them).
    """
    root = unit_of(wrapper).module
    names: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(clean_name(name))
    found: list[LocalUnit] = []
    for inner in units_in(wrapper):
        state = unit_of(inner)
        if state.unit.device_mesh_given:
            raise RuntimeError(DEVICE_MESH_REFUSED)
        for prefix in [""] if inner is wrapper else dict.fromkeys(names[id(inner)]):
            unit = _local_unit(state, prefix)
            if unit is not None:
                found.append(unit)
    return found


def _local_unit(state: UnitState, prefix: str) -> LocalUnit | None:
    module = state.module
    if not state.unit.has_params:
        return None
    view = next(v for v in layout_of(module) if any(m is module for m in v.modules))
    by_id = {id(p.param): p for p in view.params}
    named = [
        (clean_name(name), param)
        for name, param in module.named_parameters(remove_duplicate=False)
        if id(param) in by_id
    ]
    group = state.unit.process_group
    mp = state.unit.mixed_precision
    layout = unit_flat_layout(
        prefix,
        named,
        world_size=group.size(),
        use_orig_params=state.unit.use_orig_params,
        compute_dtype=None if mp is None else mp.param_dtype,
    )
    if layout is None:
        return None
    ordered = tuple(dict((id(p), by_id[id(p)]) for _, p in named).values())
    spans = tuple(ParamSpan(e, v.layout) for e, v in zip(layout.params, ordered, strict=True))
    return LocalUnit(
        layout=layout,
        params=ordered,
        exchange=FlatExchange(unit=layout, spans=spans, rank=group.rank()),
        group=group,
        use_orig_params=state.unit.use_orig_params,
    )
