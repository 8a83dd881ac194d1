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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from shardkit.core.torch_release import FOLLOWS_GRAD_DTYPE

__all__ = ["GradDtypePolicy", "hold_explicit_grads", "restore_held_grads"]


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

    def take_grad_policy(self) -> None: ...


def hold_explicit_grads(params: Iterable[_Sharded]) -> list[tuple[_Sharded, torch.Tensor]]:
    """Before ``Module._apply``: take off the gradients whose dtype a set ``grad_dtype`` decides.

    ``_apply`` would convert them with their parameters (``module.to(torch.bfloat16)`` making
    an fp32 gradient bf16); they go back as they are (``restore_held_grads``), moved only.
    """
    held = []
    for p in params:
        p.take_grad_policy()  # the new parameters come without it
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
