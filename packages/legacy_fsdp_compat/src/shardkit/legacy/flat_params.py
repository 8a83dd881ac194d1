"""FSDP1's flat parameters (``use_orig_params=False``): one 1-D parameter per unit.

The unit's ``fully_shard`` group already keeps this rank's shards of every parameter in one
flat buffer; the flat parameter *is* that buffer (``shardkit.core.layout``'s flat shard), so
an optimizer stepping it steps the sharded parameters too. Its element order is the engine's
(each parameter's shard, 16-byte aligned), not FSDP1's. See [Note: FSDP1's
use_orig_params=False on a per-parameter engine] (docs/notes/014).

Gradients: the engine reduces the unit's gradients laid out as the flat shard
(``GroupView.reduce_into_flat_layout``), gives each sharded parameter its slot as its
gradient, and then runs its post-accumulate-grad hooks; the hook here takes that reduced
tensor as the flat parameter's ``.grad`` (no copy). Where a gradient is not such a slot (a
reduction of some parameters only, a world of one that assigns autograd's own tensors), it is
copied into its slot of the flat ``.grad`` and made a view of it. Either way both name the same
memory (clipping one clips the other; an optimizer built before wrapping, which steps the
sharded parameters, still trains the model). ``zero_grad`` of either side is seen at the
root's next forward (:func:`before_forward`).

As FSDP1 does, the flat parameter is registered on the wrapped module as ``_flat_param`` and
the originals are not: the core holds them as plain attributes (``GroupView.list_params``), so
any module holding the unit, a plain root too, lists the flat parameter in their place. This
package's own code reads the originals inside :func:`per_parameter_view`, which lists them
again (and not the flat parameters) for its duration.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.core.extensions import make_dtensor
from shardkit.core.layout import GroupView, layout_of

__all__ = [
    "FLAT_NAME",
    "FlatParam",
    "before_forward",
    "check_flattenable",
    "flat_of",
    "make_flat",
    "per_parameter_view",
    "shows_flat",
]

FLAT_NAME = "_fsdp_wrapped_module._flat_param"
"""A flat parameter's name relative to its wrapper, as FSDP1 registers it."""

_FLAT_ATTR = "_flat_param"
# How many per_parameter_view contexts are open: the registration is the modules' own state,
# so it is one for the process, not per context.
_shown_depth = 0
# By id of the flat parameter: the optimizer-state APIs find a unit from the optimizer's.
# Weak: the wrapper's UnitState holds each FlatParam, and it goes with the wrapper.
_BY_FLAT: weakref.WeakValueDictionary[int, FlatParam] = weakref.WeakValueDictionary()


@dataclass(slots=True, weakref_slot=True)
class FlatParam:
    """One unit's flat parameter, over its group's flat shard."""

    group: GroupView
    holder: nn.Module
    """The wrapped module: FSDP1 registers ``_flat_param`` on it."""
    param: nn.Parameter
    """The flat parameter: a 1-D view of the group's sharded buffer."""
    originals: tuple[nn.Parameter, ...]
    """The sharded parameters (DTensors) it holds, in the group's order."""
    _grad_views: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = field(
        default=None, repr=False
    )
    trains: bool = True
    """``param.requires_grad`` as last passed on to the originals (:func:`before_forward`)."""

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each original's local shard as a view of ``flat`` (laid out as the flat parameter)."""
        return self.group.local_views(flat)

    def as_param(self, local: torch.Tensor, index: int) -> DTensor:
        """``local`` (shaped like original ``index``'s shard) as a DTensor like it, no copy."""
        p: DTensor = self.originals[index]  # type: ignore[assignment]  # a sharded DTensor
        return make_dtensor(local, p.device_mesh, p.placements, p.shape)

    def grad_view(self, index: int) -> torch.Tensor:
        """Original ``index``'s slot of the flat parameter's gradient (views made once per grad)."""
        grad = self.param.grad
        assert grad is not None
        if self._grad_views is None or self._grad_views[0] is not grad:
            self._grad_views = (grad, self.views(grad))
        return self._grad_views[1][index]

    def list_flat(self, flat: bool) -> None:
        """Register the flat parameter and unlist the originals (True), or the reverse."""
        if flat:
            self.group.list_params(False)
            self.holder.register_parameter(_FLAT_ATTR, self.param)
        else:
            if hasattr(self.holder, _FLAT_ATTR):
                delattr(self.holder, _FLAT_ATTR)
            self.group.list_params(True)

    def forget_grad_views(self) -> None:
        """Drop the views of a gradient the flat parameter no longer has (freeing it)."""
        if self._grad_views is not None and self._grad_views[0] is not self.param.grad:
            self._grad_views = None


def check_flattenable(params: list[nn.Parameter], use_orig_params: bool) -> None:
    """Refuse a unit whose parameters FSDP1 cannot flatten, with FSDP1's errors.

    Called before anything is sharded. FSDP1 checks every unit, whatever ``use_orig_params``
    is (one flat parameter holds them all): floating point, one dtype, one device, and with
    ``use_orig_params=False`` one ``requires_grad``.

    Raises:
        ValueError: an integer parameter, or two dtypes, devices or ``requires_grad``
            values (FSDP1's messages).
    """
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    requires_grad: bool | None = None
    for param in dict.fromkeys(params):  # a shared parameter once
        if dtype is None and not param.is_floating_point():
            raise ValueError("Cannot flatten integer dtype tensors")
        if dtype is not None and param.dtype != dtype:
            raise ValueError(
                f"Must flatten tensors with uniform dtype but got {dtype} and {param.dtype}"
            )
        if not use_orig_params and requires_grad not in (None, param.requires_grad):
            raise ValueError(
                "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
            )
        if device is not None and param.device != device:
            raise ValueError(
                f"Must flatten tensors on the same device but got both {device} and {param.device}"
            )
        dtype, device = param.dtype, param.device
        requires_grad = bool(requires_grad) or param.requires_grad


def make_flat(module: nn.Module) -> FlatParam | None:
    """The flat parameter of ``module``'s own group (None: it shards no parameter)."""
    group = _own_group(module)
    if group is None:
        return None
    originals = tuple(p.param for p in group.params)
    flat = FlatParam(
        group=group,
        holder=module,
        param=nn.Parameter(group.flat_shard(), any(p.requires_grad for p in originals)),
        originals=originals,
    )
    flat.trains = flat.param.requires_grad
    group.reduce_into_flat_layout()
    for index, original in enumerate(flat.originals):
        # On every original: freezing and unfreezing the flat parameter reaches them all.
        original.register_post_accumulate_grad_hook(_into_flat_grad(flat, index))
    _BY_FLAT[id(flat.param)] = flat
    flat.list_flat(shows_flat())
    return flat


def _own_group(module: nn.Module) -> GroupView | None:
    """The group of ``module``'s own ``fully_shard`` call (None: it has none)."""
    return next((g for g in layout_of(module) if any(m is module for m in g.modules)), None)


def _into_flat_grad(flat: FlatParam, index: int) -> Callable[[torch.Tensor], None]:
    def hook(original: torch.Tensor) -> None:
        grad = original.grad
        if grad is None:
            return
        if flat.param.grad is None:
            # The engine reduced into the flat layout: that tensor is the flat gradient, and
            # every original's gradient is already its slot. Else one is made and filled.
            reduced = flat.group.flat_grad_of(index)
            flat.param.grad = torch.zeros_like(flat.param) if reduced is None else reduced
        slot = flat.grad_view(index)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.data_ptr() != slot.data_ptr():
            slot.copy_(local)
            original.grad = flat.as_param(slot, index)

    return hook


def flat_of(param: torch.Tensor) -> FlatParam | None:
    """The unit of a flat parameter (None: ``param`` is none)."""
    flat = _BY_FLAT.get(id(param))
    return flat if flat is not None and flat.param is param else None


def before_forward(flats: list[FlatParam]) -> None:
    """Settle what happened since the last backward (zero_grad, moved storage, freezing)."""
    for flat in flats:
        shard = flat.group.flat_shard()
        if shard.data_ptr() != flat.param.data_ptr() or shard.dtype != flat.param.dtype:
            # Moved or retyped (module.to, an assign=True load): the same Parameter, new data.
            group = _own_group(flat.group.modules[0])
            assert group is not None, f"{flat.group.fqn}: its group is gone"
            flat.group = group
            flat.param.data = group.flat_shard()
        if flat.param.requires_grad != flat.trains:
            # Frozen or unfrozen through the flat parameter (model.requires_grad_): the
            # engine follows the originals' flags, as FSDP1 follows its flat parameter's.
            flat.trains = flat.param.requires_grad
            for p in flat.originals:
                p.requires_grad_(flat.trains)
        if flat.param.grad is None:
            for p in flat.originals:
                p.grad = None
        elif all(p.grad is None for p in flat.originals):
            flat.param.grad = None
        flat.forget_grad_views()


@contextlib.contextmanager
def per_parameter_view() -> Generator[None, None, None]:
    """Inside, modules list the sharded parameters, not flat ones (this package's own code).

    Entered first, it registers every live unit's originals again in their places and takes
    the flat parameters off; leaving the outermost one undoes it. Nested entries are free.
    """
    global _shown_depth
    _shown_depth += 1
    try:
        if _shown_depth == 1:
            _list_all_flats(False)
        yield
    finally:
        _shown_depth -= 1
        if _shown_depth == 0:
            _list_all_flats(True)


def _list_all_flats(flat: bool) -> None:
    for unit in list(_BY_FLAT.values()):
        unit.list_flat(flat)


def shows_flat() -> bool:
    """Whether modules list flat parameters now (outside :func:`per_parameter_view`)."""
    return _shown_depth == 0
