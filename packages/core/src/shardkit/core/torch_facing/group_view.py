"""A shardkit group and its parameters as torch's ``FSDPParamGroup`` and ``FSDPParam`` are read.

Torch's pipelining drives a group (``pre_backward``, ``post_backward``), torchtitan sets its
``_all_reduce_hook``, torch's ``FSDPMemTracker`` replaces its backward steps and reads its
parameters' sharded and unsharded tensors, and gradient-clipping and topology tools read its
mesh infos. Each name served here reads or drives shardkit's group through its seams. See
[Note: torch-facing view].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_common as _torch_common

from shardkit.core.state_machines import ShardedState
from shardkit.core.torch_facing.mesh_infos import as_torch_mesh_info, is_torch_mesh_info
from shardkit.core.torch_facing.param_fields import (
    TorchParamFields,
    torch_param_order,
    torch_sharded_state,
)
from shardkit.core.torch_facing.strict import Strict

if TYPE_CHECKING:
    from shardkit.core.engine.fsdp_state import FSDPState
    from shardkit.core.engine.group.param_group import FSDPParamGroup
    from shardkit.core.engine.param import FSDPParam

__all__ = ["TorchFacingGroup", "TorchFacingParam"]


class TorchFacingParam(Strict, TorchParamFields):
    """A managed parameter as torch's ``FSDPParam`` is read.

    Its name, mesh, sizes and dtypes (param_fields.py), its grad_dtype policy, its
    sharded and full parameters.
    """

    __slots__ = ("_group_view", "_param", "_param_fqn")

    def __init__(self, fqn: str, param: FSDPParam, group_view: TorchFacingGroup) -> None:
        self._param_fqn = fqn
        self._param = param
        self._group_view = group_view

    @property
    def _owner(self) -> FSDPParamGroup:
        return self._group_view._group

    @property
    def mesh_info(self) -> Any:
        """Its group's: torch's parameters share their group's mesh-info object."""
        return self._group_view.mesh_info

    @property
    def post_forward_mesh_info(self) -> Any:
        """Its group's (None: the group keeps the full parameters after forward)."""
        return self._group_view.post_forward_mesh_info

    @property
    def _has_sharded_grad_dtype_override(self) -> bool:
        # Whether its user set a grad_dtype (torch 2.15 on; see engine/grad_dtype_policy.py).
        return self._param.grad_policy.explicit

    @property
    def sharded_grad_dtype(self) -> torch.dtype | None:
        """The sharded gradient's dtype: the ``grad_dtype`` set, else the parameter's."""
        return self._param.sharded_grad_dtype

    @property
    def sharded_param(self) -> nn.Parameter:
        """The parameter the module holds between steps: a DTensor of this rank's shard."""
        return self._param.sharded_param

    @property
    def unsharded_param(self) -> nn.Parameter:
        """The full parameter the module holds while gathered (its storage freed between)."""
        param = self._param.unsharded_param
        if param is None:
            raise AttributeError(
                f"{self._param_fqn}: no unsharded parameter before its group's first all-gather"
            )
        return param

    @property
    def _unsharded_param(self) -> nn.Parameter:
        return self.unsharded_param


class TorchFacingGroup(Strict):
    """One shardkit ``FSDPParamGroup`` as torch's ``FSDPParamGroup`` is driven."""

    __slots__ = ("_group", "_state", "_torch_mesh_info", "_torch_order")

    def __init__(self, state: FSDPState, group: FSDPParamGroup) -> None:
        self._state = state
        self._group = group
        self._torch_mesh_info: Any = None
        self._torch_order: list[int] | None = None

    @property
    def fsdp_params(self) -> list[TorchFacingParam]:
        """The group's parameters in torch's order (named from the root after lazy init)."""
        group = self._group
        order = self._torch_order
        if order is None:  # the modules and their registrations are fixed by fully_shard
            order = self._torch_order = torch_param_order(group.modules, group.params)
        return [TorchFacingParam(group.param_fqns[i], group.params[i], self) for i in order]

    @property
    def mesh_info(self) -> Any:
        """Torch's mesh-info object of the group's mesh, one per group (mesh_infos.py)."""
        info = self._torch_mesh_info
        if info is None:
            info = self._torch_mesh_info = as_torch_mesh_info(self._group.mesh_info)
        if hasattr(info, "reduce_scatter_process_group"):  # torch 2.13 on
            # What set_separate_reduce_scatter_group set, read now (None: the shard group).
            info.reduce_scatter_process_group = self._group.options.reduce_scatter_group
        return info

    @property
    def post_forward_mesh_info(self) -> Any:
        """None where the group keeps its full parameters after forward, else ``mesh_info``."""
        policy = self._group.options.reshard_after_forward
        if isinstance(policy, bool):
            return self.mesh_info if policy else None
        # Not an AttributeError: a property's would be replaced by Strict's generic one.
        raise NotImplementedError(
            f"{self._name}: post_forward_mesh_info of reshard_after_forward="
            f"{policy} is not served (shardkit gathers within subgroups of {policy} ranks, not "
            "a DeviceMesh of its own); FSDPModule.set_reshard_after_forward changes the policy"
        )

    @post_forward_mesh_info.setter
    def post_forward_mesh_info(self, value: Any) -> None:
        # Libraries set what torch's set_reshard_after_forward sets: None or mesh_info itself.
        if value is None:
            self._group.options.set_reshard_after_forward(False)
        elif is_torch_mesh_info(value) and value == self.mesh_info:
            self._group.options.set_reshard_after_forward(True)
        else:
            raise ValueError(
                f"{self._name}: post_forward_mesh_info takes None (keep the "
                "full parameters after forward) or the group's mesh_info (reshard them), not "
                f"{value!r}: resharding to fewer ranks is fully_shard's "
                "reshard_after_forward=n on shardkit"
            )

    # What the group holds now and what it is doing, as torch's enums and predicates.

    @property
    def _sharded_state(self) -> Any:
        return torch_sharded_state(self._group.sharded_state)

    @property
    def is_sharded(self) -> bool:
        """Whether the sharded parameters are registered (no full storage held)."""
        return self._group.sharded_state is ShardedState.SHARDED

    @property
    def is_sharded_post_forward(self) -> bool:
        """Whether it holds 1/n slices after forward (``reshard_after_forward=n``)."""
        return self._group.sharded_state is ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        """Whether the full parameters are registered."""
        return self._group.sharded_state is ShardedState.UNSHARDED

    @property
    def _training_state(self) -> Any:
        return _torch_common.TrainingState[self._group.training_state.name]

    @property
    def _name(self) -> str:
        """For messages: the group's name from the root, or its modules' classes before it."""
        return self._group.fqn or ", ".join(type(m).__name__ for m in self._state.modules)

    @property
    def _module_fqn(self) -> str:
        return self._group.torch_fqn

    @property
    def _all_reduce_hook(self) -> Callable[[torch.Tensor], None] | None:
        return self._group.options.all_reduce_hook

    @_all_reduce_hook.setter
    def _all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        # What FSDPModule.set_all_reduce_hook sets, for this group only (as torch's).
        self._group.options.all_reduce_hook = hook

    # torch's group methods a tool may replace (FSDPMemTracker wraps both): reading gives the
    # replacement or the group's own; setting the group's own back removes the replacement.
    # The engine runs each step through the replacement (engine/replaceable_hooks.py).

    @property
    def pre_backward(self) -> Callable[..., None]:
        """Gather this group for its backward and prefetch the next (``(default_prefetch)``)."""
        return self._group.replaced.replacement("pre_backward") or self._own_pre_backward

    @pre_backward.setter
    def pre_backward(self, method: Callable[..., None]) -> None:
        self._group.replaced.replace("pre_backward", None if self._is_own(method) else method)

    @property
    def post_backward(self) -> Callable[..., None]:
        """End this group's backward now: take its gradients, reshard as set, reduce.

        A pipeline schedule calls it once a stage's microbatches are done (torch 2.13's
        REDUCE_GRAD); the root's driver does what autograd's end of a group's backward does.
        A group whose root never ran forward has nothing to end.
        """
        return self._group.replaced.replacement("post_backward") or self._own_post_backward

    @post_backward.setter
    def post_backward(self, method: Callable[..., None]) -> None:
        self._group.replaced.replace("post_backward", None if self._is_own(method) else method)

    def _own_pre_backward(self, *unused: Any) -> None:
        ctx, group = self._state.ctx, self._group
        direct = (lambda: ctx.driver.pre_backward(group)) if ctx is not None else _nothing
        group.replaced.run_original("pre_backward", direct)

    def _own_post_backward(self, *unused: Any) -> None:
        ctx, group = self._state.ctx, self._group
        direct = (lambda: ctx.driver.end_backward(group)) if ctx is not None else _nothing
        group.replaced.run_original("post_backward", direct)

    def _is_own(self, method: Callable[..., None]) -> bool:
        owner = getattr(method, "__self__", None)
        return isinstance(owner, TorchFacingGroup) and owner._group is self._group


def _nothing() -> None:
    pass
