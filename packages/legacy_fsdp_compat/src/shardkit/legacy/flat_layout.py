"""FSDP1's flat-parameter layout, computed from the model definition and FSDP1's settings.

torch's FSDP1 (``FullyShardedDataParallel``) flattens the parameters of each *unit* (the root
and every module its auto-wrap policy wraps) into one 1-D ``FlatParameter`` and shards it
across ranks. A LOCAL_STATE_DICT checkpoint holds each rank's piece of every unit's flat
tensor and nothing about what lies where: that must be computed again from what FSDP1 was
given. This module does it on a model built on the meta device, with no process group.
See [Note: FSDP1 flat parameters] (docs/notes/010-fsdp1-checkpoints.md) for the rules.

Next to split off: which modules become units, in FSDP1's wrapping order
(``_units_in_wrap_order``, ``_post_order``, ``_policy_targets``, ``_recursive_targets``,
``_LAYOUT_ARGUMENTS``) into ``flat_wrap_order.py``: they ask the policy and walk the module tree,
never touch the flat-parameter types, and ``flat_param_layout`` calls only the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from shardkit.legacy.torch_compat import classes_kept_in_full_precision, torch_policy_targets

__all__ = [
    "FlatParamEntry",
    "FlatParamLayout",
    "FlatParamUnit",
    "ShardPiece",
    "WrapPolicy",
    "flat_param_layout",
    "unit_flat_layout",
]

WrapPolicy: TypeAlias = (
    ModuleWrapPolicy | CustomPolicy | Callable[..., bool] | Collection[type[nn.Module]]
)
"""What FSDP1 took as ``auto_wrap_policy``: a ``ModuleWrapPolicy`` or ``CustomPolicy``, a
callable ``(module, recurse, nonwrapped_numel) -> bool`` (``functools.partial`` of
``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``, ...), or simply the module
classes to wrap (as ``ModuleWrapPolicy`` would)."""

_ALIGN_BYTES = 16  # FSDP1 starts each parameter on a 16-byte boundary (use_orig_params=True)
# CustomPolicy may give a unit its own FSDP1 arguments; these would change its layout.
_LAYOUT_ARGUMENTS = frozenset({"mixed_precision", "use_orig_params", "sharding_strategy"})


class ShardPiece(NamedTuple):
    """A stretch of one rank's local shard (LOCAL_STATE_DICT's tensor for a unit)."""

    rank: int
    start: int
    """First element, in the rank's local shard."""
    stop: int
    """One past the last element."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatParamEntry:
    """One parameter inside a unit's flat parameter."""

    fqn: str
    """Its name from the model's root (the first name, when it has several)."""
    aliases: tuple[str, ...]
    """Its other names inside the unit (a tied parameter is stored once)."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """Strides of the parameter; FSDP1 flattens a non-contiguous one in memory order."""
    offset: int
    """Its first element in the unit's unsharded flat parameter (padding included)."""
    numel: int

    @property
    def contiguous(self) -> bool:
        """Whether the flat elements are in row-major order (else ``as_strided`` order)."""
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride, strict=True))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter from its ``numel`` flat elements (a view where they are row-major)."""
        if self.contiguous:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.stride)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatParamUnit:
    """One FSDP1 unit: the module it wraps and the layout of its flat parameter."""

    prefix: str
    """The wrapped module's name from the root ("" for the root)."""
    dtype: torch.dtype
    """The flat parameter's dtype (its parameters' own; mixed precision casts only copies)."""
    params: tuple[FlatParamEntry, ...]
    numel: int
    """Unsharded numel with alignment padding, before evening up for sharding: the global
    size of the unit's LOCAL_STATE_DICT tensor (FSDP1's ``_unpadded_unsharded_size``)."""
    world_size: int

    @property
    def state_dict_key(self) -> str:
        """The unit's key in a LOCAL_STATE_DICT (``blocks.0._flat_param``, ``_flat_param``)."""
        return f"{self.prefix}._flat_param" if self.prefix else "_flat_param"

    @property
    def shard_numel(self) -> int:
        """Every rank's padded shard size: ``flat.chunk(world_size)``'s first chunk."""
        return math.ceil(self.numel / self.world_size)

    def shard_offset(self, rank: int) -> int:
        """Where ``rank``'s shard starts in the unsharded flat parameter."""
        return self.shard_numel * rank

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard that hold data (LOCAL_STATE_DICT drops the rest)."""
        start = self.shard_offset(rank)
        return max(0, min(start + self.shard_numel, self.numel) - start)

    def pieces(self, entry: FlatParamEntry) -> tuple[ShardPiece, ...]:
        """Where ``entry``'s elements lie in the ranks' local shards, in order."""
        found: list[ShardPiece] = []
        end = entry.offset + entry.numel
        for rank in range(self.world_size):
            start = self.shard_offset(rank)
            lo, hi = max(entry.offset, start), min(end, start + self.local_numel(rank))
            if lo < hi:
                found.append(ShardPiece(rank, lo - start, hi - start))
        return tuple(found)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatParamLayout:
    """Every FSDP1 unit of a model, in FSDP1's wrapping order (children before parents)."""

    world_size: int
    units: tuple[FlatParamUnit, ...]

    def find(self, fqn: str) -> tuple[FlatParamUnit, FlatParamEntry]:
        """The unit and entry holding the parameter named ``fqn`` (any of its names).

        Raises:
            KeyError: no unit holds a parameter of that name.
        """
        for unit in self.units:
            for entry in unit.params:
                if fqn == entry.fqn or fqn in entry.aliases:
                    return unit, entry
        raise KeyError(f"no FSDP1 unit holds a parameter named {fqn!r}")


def flat_param_layout(
    model: nn.Module,
    *,
    world_size: int,
    auto_wrap_policy: WrapPolicy | None = None,
    use_orig_params: bool = False,
    mixed_precision: MixedPrecision | None = None,
) -> FlatParamLayout:
    """The flat-parameter layout FSDP1 gives ``model`` with these settings.

    The keyword arguments are FSDP1's own, with the values it was given.

    Args:
        model: the model as given to FSDP1, before wrapping; built on the meta device is
            best (only names, shapes, strides, dtypes and sharing are read).
        world_size: ranks in FSDP1's process group (the shard group's size under HYBRID_SHARD).
        auto_wrap_policy: FSDP1's ``auto_wrap_policy`` (see :data:`WrapPolicy`); None: the
            root is the only unit.
        use_orig_params: FSDP1's ``use_orig_params``: True aligns every parameter to 16 bytes
            of its compute dtype and pads the flat parameter to a multiple of ``world_size``.
        mixed_precision: FSDP1's ``mixed_precision``. Its ``param_dtype`` is the dtype that
            alignment counts in; with an auto-wrap policy, modules of its
            ``_module_classes_to_ignore`` (BatchNorm by default) become units of their own
            and keep their parameters' dtype.

    Raises:
        ValueError: ``world_size`` below 1, a unit whose parameters have several dtypes, or a
            CustomPolicy giving a unit settings that change its layout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    kept: tuple[type[nn.Module], ...] = ()  # classes kept in full precision, units of their own
    if mixed_precision is not None and auto_wrap_policy is not None:
        kept = classes_kept_in_full_precision(mixed_precision)
    param_dtype = None if mixed_precision is None else mixed_precision.param_dtype
    claimed: set[int] = set()  # ids of parameters already in a unit
    units: list[FlatParamUnit] = []
    for module in _units_in_wrap_order(model, auto_wrap_policy, kept):
        unit = unit_flat_layout(
            names[id(module)],
            _unit_params(module, claimed),
            world_size=world_size,
            use_orig_params=use_orig_params,
            compute_dtype=None if isinstance(module, kept) else param_dtype,
        )
        if unit is not None:
            units.append(unit)
    return FlatParamLayout(world_size=world_size, units=tuple(units))


def unit_flat_layout(
    prefix: str,
    named: list[tuple[str, nn.Parameter]],
    *,
    world_size: int,
    use_orig_params: bool,
    compute_dtype: torch.dtype | None,
) -> FlatParamUnit | None:
    """The flat parameter FSDP1 makes of one unit's parameters (None without any).

    Args:
        prefix: the unit's module name from the root ("" for the root).
        named: (name from the unit's module, parameter) in FSDP1's order: modules in
            pre-order, each one's own parameters, tied ones once per name.
        world_size: ranks the unit is sharded over.
        use_orig_params: FSDP1's ``use_orig_params`` (alignment padding when True).
        compute_dtype: the unit's ``param_dtype``, which alignment counts in (None: its own).
    """
    layout = _Layout(
        prefix=prefix,
        world_size=world_size,
        use_orig_params=use_orig_params,
        compute_dtype=compute_dtype,
    )
    return layout.build(named)


def _unit_params(module: nn.Module, claimed: set[int]) -> list[tuple[str, nn.Parameter]]:
    """(name from ``module``, parameter) of the parameters ``module``'s unit takes, in order.

    Modules in pre-order, then each one's own parameters; a parameter claimed by a unit
    wrapped earlier (a wrapped child) is skipped. Tied parameters come once per name.
    """
    found: list[tuple[str, nn.Parameter]] = []
    taken: set[int] = set()
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in claimed:
                continue
            found.append((f"{module_name}.{name}" if module_name else name, param))
            taken.add(id(param))
    claimed |= taken
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layout:
    """How one unit's parameters are laid out: FSDP1's flattening rules."""

    prefix: str
    world_size: int
    use_orig_params: bool
    compute_dtype: torch.dtype | None

    def build(self, named: list[tuple[str, nn.Parameter]]) -> FlatParamUnit | None:
        """The unit of these parameters (None without any: FSDP1 makes no flat parameter)."""
        if not named:
            return None
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise ValueError(
                f"FSDP1 unit {self.prefix or '(root)'}: its parameters have several dtypes "
                f"{sorted(map(str, dtypes))}; FSDP1 flattens one dtype per unit"
            )
        dtype = dtypes.pop()
        align = self._aligned_numel(dtype)
        entries: list[FlatParamEntry] = []
        by_param: dict[int, int] = {}  # id(parameter) -> index in entries
        total = 0
        for name, param in named:
            fqn = f"{self.prefix}.{name}" if self.prefix else name
            if id(param) in by_param:  # tied: stored once, under its first name
                index = by_param[id(param)]
                first = entries[index]
                entries[index] = _with_alias(first, fqn)
                continue
            total += _padding(total, align)
            by_param[id(param)] = len(entries)
            entries.append(_entry(fqn, param, total))
            total += param.numel()
        if align:
            total += _padding(total, self.world_size)
        return FlatParamUnit(
            prefix=self.prefix,
            dtype=dtype,
            params=tuple(entries),
            numel=total,
            world_size=self.world_size,
        )

    def _aligned_numel(self, dtype: torch.dtype) -> int:
        """Elements per alignment step; 0 without alignment (use_orig_params=False)."""
        if not self.use_orig_params:
            return 0
        return _ALIGN_BYTES // (self.compute_dtype or dtype).itemsize


def _padding(total: int, multiple: int) -> int:
    """Elements that bring ``total`` to a multiple of ``multiple`` (0 when it is one)."""
    return -total % multiple if multiple else 0


def _entry(fqn: str, param: nn.Parameter, offset: int) -> FlatParamEntry:
    return FlatParamEntry(
        fqn=fqn,
        aliases=(),
        shape=tuple(param.shape),
        stride=tuple(param.stride()),
        offset=offset,
        numel=param.numel(),
    )


def _with_alias(entry: FlatParamEntry, alias: str) -> FlatParamEntry:
    return FlatParamEntry(
        fqn=entry.fqn,
        aliases=(*entry.aliases, alias),
        shape=entry.shape,
        stride=entry.stride,
        offset=entry.offset,
        numel=entry.numel,
    )


def _units_in_wrap_order(
    model: nn.Module, policy: WrapPolicy | None, kept: tuple[type[nn.Module], ...]
) -> Iterator[nn.Module]:
    """The modules FSDP1 wraps, in the order it wraps them; the root last.

    Wrapping goes bottom up, so a unit takes what its wrapped descendants left. Modules of
    the ``kept`` classes (mixed precision's full-precision ones) are wrapped whatever the
    policy says.
    """
    if policy is None:
        yield model
        return
    if isinstance(policy, ModuleWrapPolicy | CustomPolicy):
        targets = _policy_targets(model, policy)
    elif callable(policy):
        targets = _recursive_targets(model, policy, kept)
    else:
        classes = tuple(policy)
        targets = {id(m) for m in model.modules() if isinstance(m, classes)}
    targets |= {id(m) for m in model.modules() if isinstance(m, kept)}
    yield from _post_order(model, targets)
    yield model


def _post_order(root: nn.Module, targets: set[int]) -> Iterator[nn.Module]:
    """Targets below ``root``, children before parents, each module visited once."""
    seen: set[int] = {id(root)}

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from visit(child)
                if id(child) in targets:
                    yield child

    yield from visit(root)


def _policy_targets(model: nn.Module, policy: ModuleWrapPolicy | CustomPolicy) -> set[int]:
    """The modules a ``ModuleWrapPolicy`` or ``CustomPolicy`` picks (ids).

    The policy's own ``_run_policy`` decides, as in FSDP1: torch's one entry point to it.
    """
    chosen = torch_policy_targets(policy, model, set(), {})
    for module, arguments in chosen.items():
        changed = _LAYOUT_ARGUMENTS & set(arguments)
        if changed:
            raise ValueError(
                f"the wrap policy gives {type(module).__name__} its own {sorted(changed)}: "
                "per-unit settings that change the flat layout are not supported"
            )
    return {id(m) for m in chosen}


def _recursive_targets(
    model: nn.Module, policy: Callable[..., bool], kept: tuple[type[nn.Module], ...]
) -> set[int]:
    """The modules a callable policy picks, asked as FSDP1 asks it (ids).

    FSDP1 walks down while ``policy(recurse=True)`` says so, then, children first, wraps a
    module when ``policy(recurse=False)`` agrees given the parameters not yet wrapped below
    it (``nonwrapped_numel``); the root is never asked. With ``kept`` classes (mixed
    precision) FSDP1 asks "policy or kept class" instead, which always walks down.
    """
    targets: set[int] = set()

    def asked(module: nn.Module, recurse: bool, nonwrapped: int) -> bool:
        if policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped):
            return True
        return bool(kept) and (recurse or isinstance(module, kept))

    def decide(module: nn.Module, *, is_root: bool) -> int:
        """Wraps below ``module``; returns the numel now wrapped in its subtree."""
        nonwrapped = sum(p.numel() for p in module.parameters())
        if not asked(module, True, nonwrapped):
            return 0
        wrapped = sum(decide(child, is_root=False) for child in module.children())
        if not is_root and asked(module, False, nonwrapped - wrapped):
            targets.add(id(module))
            return nonwrapped
        return wrapped

    decide(model, is_root=True)
    return targets
