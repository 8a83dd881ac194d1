"""A parameter's ``grad_dtype`` as its user set it: kept through sharding (torch 2.15 on).

From torch 2.15, ``fully_shard`` honours a ``grad_dtype`` set on a parameter (``p.grad_dtype =
torch.float32`` on a bf16 parameter: fp32 gradients; ``None``: any dtype) before lazy
initialization. The setting is part of the parameter's contract with the optimizer, so it must
outlive everything that replaces the parameter object:

- the sharded parameter made by ``fully_shard`` carries it;
- ``module.to(dtype)`` and ``load_state_dict(assign=True)`` register new parameters without
  one: the policy carries over (an explicit setting is never unset), and a parameter with no
  explicit setting follows its new dtype;
- with ``MixedPrecisionPolicy.reduce_dtype`` unset, the unsharded gradient accumulates in the
  set dtype, the group reduces in the widest of its parameters' dtypes, and each sharded
  gradient arrives in its parameter's set dtype.

Releases before 2.15 ignore the setting (their ``fully_shard`` builds the sharded parameter
without it), and so does shardkit there: ``FOLLOWS_GRAD_DTYPE`` is off and every policy is
implicit. See [Note: post-backward trigger] for how accumulation uses the dtype.

The dtype the group's plan has a parameter's full gradients accumulate in, which follows that
setting, is the unsharded parameter's ``grad_dtype`` from torch 2.15 on: ``GradAccumulation``,
which each ``FSDPParam`` holds, sets it and lifts it while a backward runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from shardkit.core.extensions import ParamShardingSpec
from shardkit.core.torch_release import ACCUMULATES_IN_GRAD_DTYPE, FOLLOWS_GRAD_DTYPE

__all__ = [
    "GradAccumulation",
    "GradDtypePolicy",
    "hold_explicit_grads",
    "restore_held_grads",
    "take_grad_policy",
]


@dataclass(slots=True)
class GradDtypePolicy:
    """Whether the user set ``grad_dtype`` on the parameter, and to what."""

    explicit: bool = False
    """Set by the user (it survives dtype conversions); False: the parameter's own dtype."""
    dtype: torch.dtype | None = None
    """The dtype set (None: gradients of any dtype). Meaningless unless ``explicit``."""

    @classmethod
    def of(cls, param: torch.Tensor) -> GradDtypePolicy:
        """The policy ``param`` carries (implicit where the release ignores the setting)."""
        policy = cls()
        policy.take_from(param)
        return policy

    def take_from(self, param: torch.Tensor) -> None:
        """Adopt ``param``'s setting if it has an explicit one.

        A parameter without one (rebuilt by ``Module._apply``, loaded with ``assign=True``)
        leaves the policy as it was: an explicit setting cannot be unset.
        """
        if FOLLOWS_GRAD_DTYPE and getattr(param, "_has_grad_dtype_override", False):
            self.explicit, self.dtype = True, param.grad_dtype

    def put_on(self, param: nn.Parameter) -> None:
        """Give ``param`` (a new sharded parameter) the setting, where it is explicit."""
        if self.explicit and not (
            getattr(param, "_has_grad_dtype_override", False) and param.grad_dtype == self.dtype
        ):
            param.grad_dtype = self.dtype

    def sharded_grad_dtype(self, own: torch.dtype) -> torch.dtype | None:
        """The dtype of the sharded gradient (None: the reduction's), for a parameter of ``own``."""
        return self.dtype if self.explicit else own


class _Sharded(Protocol):
    grad_policy: GradDtypePolicy
    sharded_param: nn.Parameter


def take_grad_policy(param: _Sharded) -> None:
    """Adopt a ``grad_dtype`` set on ``param``'s sharded parameter since it was made.

    Its user may set one until lazy initialization, as with torch's ``fully_shard``.
    """
    param.grad_policy.take_from(param.sharded_param)


def hold_explicit_grads(params: Iterable[_Sharded]) -> list[tuple[_Sharded, torch.Tensor]]:
    """Before ``Module._apply``: take off the gradients whose dtype a set ``grad_dtype`` decides.

    ``_apply`` would convert them with their parameters (``module.to(torch.bfloat16)`` making
    an fp32 gradient bf16); they go back as they are (``restore_held_grads``), moved only.
    """
    held = []
    for p in params:
        take_grad_policy(p)  # the new parameters come without it
        grad = p.sharded_param.grad
        if grad is not None and p.grad_policy.explicit:
            held.append((p, grad))
            p.sharded_param.grad = None
    return held


def restore_held_grads(held: list[tuple[_Sharded, torch.Tensor]]) -> None:
    """After ``Module._apply`` (and the groups' resync): the held gradients back, moved."""
    with torch.no_grad():
        for p, grad in held:
            param = p.sharded_param
            p.grad_policy.put_on(param)
            param.grad = grad.to(device=param.device).requires_grad_(grad.requires_grad)


@dataclass(slots=True)
class GradAccumulation:
    """The dtype a parameter's full gradients accumulate in inside autograd (torch 2.15 on).

    The group's plan gives it (``FSDPParam.follow_plan_dtypes``); it is set on the unsharded
    parameter as its ``grad_dtype``, so autograd casts each gradient it makes for the
    parameter before summing. A wider one is lifted while a backward runs where autograd's
    cast buys nothing (``defer_upcast``), and set again where the group's backward ends
    (``upcast_held``). See [Note: post-backward trigger].
    """

    dtype: torch.dtype | None = None
    """torch 2.15 on: the unsharded parameter's ``grad_dtype`` (set with its comm dtype)."""
    any_dtype: bool = False
    """``grad_dtype=None`` set and no ``reduce_dtype``: gradients of any dtype."""
    defers_upcast: bool = False
    """Whether autograd's cast to ``dtype`` is lifted while a backward runs (see ``follow``)."""

    def follow(
        self,
        spec: ParamShardingSpec,
        comm_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        *,
        any_dtype: bool,
    ) -> None:
        """Take the plan's dtypes for a parameter sharded as ``spec``.

        ``comm_dtype``: the unsharded parameter's; ``reduce_dtype``: the one its full gradients
        accumulate in; ``any_dtype``: ``grad_dtype=None`` as its user set.
        """
        self.any_dtype = any_dtype
        floating = comm_dtype.is_floating_point and reduce_dtype.is_floating_point
        follows = ACCUMULATES_IN_GRAD_DTYPE and floating
        self.dtype = reduce_dtype if follows else None
        # A gradient that tensor parallelism sums before FSDP reduces it (a parameter
        # replicated over a TP axis: its gradient may be Partial there) keeps autograd's cast,
        # as torch 2.15 does, so that sum runs in the reduce dtype too. Only a wider dtype is
        # lifted while a backward runs (defer_upcast). See [Note: post-backward trigger].
        summed_outside_dp = spec.unsharded_mesh is not None and any(
            isinstance(placement, Replicate) and axis not in spec.dp_axes
            for axis, placement in enumerate(spec.unsharded_placements)
        )
        wider = reduce_dtype.itemsize > comm_dtype.itemsize
        self.defers_upcast = follows and wider and not summed_outside_dp and not any_dtype

    def set_on(self, param: nn.Parameter) -> None:
        """Give ``param`` (the unsharded parameter) the accumulation dtype as its ``grad_dtype``."""
        if self.dtype is not None:
            param.grad_dtype = None if self.any_dtype else self.dtype

    def defer_upcast(self, param: nn.Parameter | None, reducing: bool) -> None:
        """At the group's pre-backward (torch 2.15 on): let autograd's gradient keep its dtype.

        A gradient this backward's reduction takes is upcast when the reduction packs it,
        and one added to a held gradient (already wide) by the in-place add: only the first
        gradient of an accumulation needs autograd's cast, so only then is ``grad_dtype`` kept.
        ``param``: the unsharded parameter (None: not made yet); ``reducing``: the group's
        gradient sync is on.
        """
        if not self.defers_upcast or param is None or not param.requires_grad:
            return
        if param.grad is not None or reducing:
            param.grad_dtype = None

    def upcast_held(self, param: nn.Parameter | None) -> None:
        """Where a group's backward ends (torch 2.15 on): back to the accumulation dtype.

        The gradient held on ``param`` (the unsharded parameter), and what autograd adds to it
        from now on.
        """
        if not self.defers_upcast or param is None or not param.requires_grad:
            return
        dtype = self.dtype
        grad = param.grad
        if grad is not None and grad.dtype != dtype:
            param.grad = grad.to(dtype)  # made while the upcast was deferred
        param.grad_dtype = dtype
