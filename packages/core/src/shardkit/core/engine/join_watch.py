"""An active rank's view of what it does between its iterations' engine collectives, under Join.

While some rank is out of batches (``engine/join``), each active rank runs its iteration under
a :class:`~shardkit.core.runtime.watch.collective_watch.CollectiveWatch` with this policy. It tells
apart three things the joined rank must learn of:

- **A gradient norm** (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``): DTensor's norm
  operators on the module's gradients (``_foreach_norm``, ``linalg_vector_norm``), then the
  all-reduce that makes the norm whole. Before that all-reduce goes out, the owner announces
  it (``Kind.NORM``) and the joined rank computes the same norm over its own shards: its
  shards hold its part of the averaged gradient, so it both adds its part to the norm and
  learns the norm the others clip with.
- **Gradient scaling** (clipping's ``mul_`` by the clip coefficient): no collective, but the
  joined rank's shards must be scaled alike before its optimizer step. The factors are kept
  per parameter and sent with the step (``Kind.STEP``).
- **Anything else**: another collective (a loss all-reduced for logging), or another change
  to the gradients (``clip_grad_value_``'s clamps). The joined rank cannot shadow it: the
  collective is held back and the first such thing is kept, for the owner to raise on every
  rank at its next announcement.

Inside the optimizer's step (``stepping``) everything passes: the joined rank steps too.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from shardkit.core.runtime.dtensors import local_of
from shardkit.core.runtime.watch.collective_watch import collective_name

__all__ = [
    "GradNorm",
    "JoinWatchPolicy",
    "NormOwner",
    "StepOwner",
    "scale_grads",
    "shadow_norm",
    "watch_steps",
]

_aten = torch.ops.aten
_NORMS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)
_SCALES = (
    _aten._foreach_mul_.Tensor,
    _aten._foreach_mul_.Scalar,
    _aten.mul_.Tensor,
    _aten.mul_.Scalar,
)
_CLEARS = (_aten._foreach_zero_.default, _aten.zero_.default)


@dataclass(slots=True)
class GradNorm:
    """A norm over gradients whose all-reduce has not gone out yet."""

    norm_type: float
    foreach: bool
    covers: list[bool]
    """Per trainable parameter of the module: whether its gradient is in the norm."""


class NormOwner(Protocol):
    """Who announces a norm before its all-reduce goes out (the join hook)."""

    def announce_norm(self, norm: GradNorm) -> bool:
        """Tell the joined ranks; False where they do not listen (the norm is held back).

        Raises instead where something else could not be shadowed.
        """


@dataclass(slots=True)
class JoinWatchPolicy:
    """The :class:`~shardkit.core.runtime.watch.collective_watch.WatchPolicy` of an active rank."""

    owner: NormOwner
    params: list[nn.Parameter]
    """The module's trainable parameters (sharded), in the order both sides index them."""
    stepping: bool = False
    norm: GradNorm | None = None
    scales: list[float] = field(default_factory=list)
    unshadowable: str | None = None
    """The first thing the joined rank cannot shadow, named for the error."""

    def alive(self) -> bool:
        """Whether the join hook lives (the policy holds it weakly: its life is the Join's)."""
        try:
            return self.owner.announce_norm is not None
        except ReferenceError:
            return False

    def begin_iteration(self) -> None:
        """A new iteration: nothing scaled, no norm pending."""
        self.norm = None
        self.scales = [1.0] * len(self.params)

    def on_dtensor_op(self, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> None:
        """Keep a norm's operators and the scaling of gradients; name other changes to them."""
        if self.stepping:
            return
        if func in _NORMS:
            self._norm(func, args)
        elif func._schema.is_mutable and func not in _CLEARS:
            touched = self._indices(_tensors(args[0]))
            if not touched:
                return
            if func in _SCALES and len(args) > 1 and _scalar(args[1]) is not None:
                factor = _scalar(args[1])
                assert factor is not None
                for i in touched:
                    self.scales[i] *= factor
            elif self.unshadowable is None:
                self.unshadowable = f"{func} on the gradients"

    def issues(self, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
        """A norm's all-reduce goes out once announced; other collectives are held back."""
        if self.stepping or _from_a_joinable():
            return True
        name = collective_name(func)
        if self.norm is not None and name == "_c10d_functional.all_reduce":
            norm, self.norm = self.norm, None
            return self.owner.announce_norm(norm)
        if self.unshadowable is None:
            self.unshadowable = _user_facing(name)
        return False

    def _norm(self, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> None:
        touched = self._indices(_tensors(args[0]))
        if not touched:
            return
        order = float(args[1]) if len(args) > 1 and args[1] is not None else 2.0
        if self.norm is None:
            covers = [False] * len(self.params)
            self.norm = GradNorm(order, func is _aten._foreach_norm.Scalar, covers)
        for i in touched:
            self.norm.covers[i] = True

    def _indices(self, tensors: list[torch.Tensor]) -> list[int]:
        """The indices of the module's parameters whose gradients are among ``tensors``."""
        if not any(isinstance(t, DTensor) for t in tensors):
            return []
        index = {id(p.grad): i for i, p in enumerate(self.params) if p.grad is not None}
        return [index[id(t)] for t in tensors if id(t) in index]


def _from_a_joinable() -> bool:
    """Whether a method of a torch ``Joinable`` other than a module issues it.

    That Joinable's own join hook shadows it on the joined ranks (torch's pattern for a user's
    collective), after this one's, in the same turn of their loop.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, Joinable) and not isinstance(owner, nn.Module):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, list | tuple):
        return [t for t in arg if isinstance(t, torch.Tensor)]
    return []


def _scalar(arg: Any) -> float | None:
    """A scale factor that is one number for every gradient (a one-element tensor, or a number)."""
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, torch.Tensor) and arg.numel() == 1:
        local = local_of(arg) if isinstance(arg, DTensor) else arg
        value = float(local.item())
        return value if math.isfinite(value) else None
    return None


# The c10d operators behind torch.distributed's functions, by the names users call.
_USER_NAMES = {
    "c10d.allreduce_": "torch.distributed.all_reduce",
    "c10d.allgather_": "torch.distributed.all_gather",
    "c10d._allgather_base_": "torch.distributed.all_gather_into_tensor",
    "c10d.broadcast_": "torch.distributed.broadcast",
    "c10d.reduce_": "torch.distributed.reduce",
    "c10d.reduce_scatter_": "torch.distributed.reduce_scatter",
    "c10d._reduce_scatter_base_": "torch.distributed.reduce_scatter_tensor",
    "c10d.barrier": "torch.distributed.barrier",
    "c10d.alltoall_base_": "torch.distributed.all_to_all_single",
    "c10d.gather_": "torch.distributed.gather",
    "c10d.scatter_": "torch.distributed.scatter",
}


def _user_facing(name: str) -> str:
    user = _USER_NAMES.get(name)
    return f"{user} ({name})" if user else name


class StepOwner(Protocol):
    """Who announces an optimizer step (the join hook)."""

    def before_step(self) -> None:
        """The optimizer is about to step."""

    def after_step(self) -> None:
        """The optimizer stepped."""


def watch_steps(optimizer: torch.optim.Optimizer, owner: StepOwner) -> list[RemovableHandle]:
    """Step hooks on ``optimizer`` that tell ``owner``.

    They hold it weakly: its life is the Join's, and the optimizer outlives it.
    """
    ref = weakref.ref(owner)

    def before(*_: Any) -> None:
        live = ref()
        if live is not None:
            live.before_step()

    def after(*_: Any) -> None:
        live = ref()
        if live is not None:
            live.after_step()

    return [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]


# --- the joined rank's side ------------------------------------------------------------------


def shadow_norm(
    params: list[nn.Parameter], covers: list[bool], norm_type: float, foreach: bool | None
) -> None:
    """The norm the active ranks announced, over this rank's shards: the same collectives."""
    grads = [p.grad for p, c in zip(params, covers, strict=True) if c and p.grad is not None]
    assert len(grads) == sum(covers), "a norm over gradients this rank does not hold"
    norm = torch.nn.utils.get_total_norm(
        grads, norm_type, error_if_nonfinite=False, foreach=foreach
    )
    if isinstance(norm, DTensor):
        # A max norm stays partial until it is used: the active ranks all-reduce it where
        # they use it (the clip coefficient), this rank here.
        norm.full_tensor()


def scale_grads(params: list[nn.Parameter], scales: list[float]) -> None:
    """Scale this rank's shards of the gradients as the active ranks scaled theirs."""
    with torch.no_grad():
        for param, scale in zip(params, scales, strict=True):
            if param.grad is not None and scale != 1.0:
                local = local_of(param.grad)
                local.mul_(torch.tensor(scale, dtype=local.dtype, device=local.device))
