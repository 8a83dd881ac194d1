"""The torch-facing view: torch's private FSDP names, served on shardkit's engine.

Torch's pipelining (2.13: ``fully_shard.state(m)._state_ctx.all_states``, each state's
``_fsdp_param_groups``, each group's ``post_backward()``, ``_root_post_backward_final_callback``),
torchtitan's cross-replica all-reduce (``m._get_fsdp_state()._fsdp_param_groups[i]
._all_reduce_hook``) and torch's own lazy-init tests read torch's private FSDP objects. A
shardkit module answers them with a view of its ``FSDPState``: each name it serves drives the
engine through its seams (the root's ``StepDriver``, a group's options); any other name raises
an ``AttributeError`` that names shardkit and the attribute. See [Note: torch-facing view].

The view is kept where torch's composable-API decorator keeps a call's state (the module's
``__dict__``, under torch's ``fully_shard``, or its ``replicate`` for shardkit's
``replicate``), so torch's ``fully_shard.state(m)`` (``replicate.state(m)``) finds it too,
whichever function a library imported.

Next to split off: where the views are kept on the modules (``attach_view``, ``view_of``,
``api_view``), into a module of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._composable.contract import STATE_KEY as _TORCH_STATE_KEY
from torch.distributed.fsdp._fully_shard import _fsdp_common as _torch_common
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _torch_fully_shard

try:  # torch's replicate on FSDP's engine (its ReplicateModule: the pipelining stage's check)
    from torch.distributed._composable.replicate_with_fsdp import replicate as _torch_replicate
except ImportError:  # a torch without it: nothing reads a replicate state there
    _torch_replicate = None  # type: ignore[assignment]

from shardkit.core.state_machines import ShardedState
from shardkit.core.torch_facing.mesh_infos import as_torch_mesh_info, is_torch_mesh_info
from shardkit.core.torch_facing.param_fields import (
    TorchParamFields,
    torch_param_order,
    torch_sharded_state,
)
from shardkit.core.torch_facing.state_mapping import enter_torch_state

if TYPE_CHECKING:
    from shardkit.core.engine.fsdp_state import FSDPState
    from shardkit.core.engine.group.param_group import FSDPParamGroup
    from shardkit.core.engine.param import FSDPParam

__all__ = [
    "TorchFacingGroup",
    "TorchFacingParam",
    "TorchFacingState",
    "api_view",
    "attach_view",
    "view_of",
]

logger = logging.getLogger(__name__)

# The keys torch's decorator files each API's state under: the undecorated function.
_TORCH_KEYS: dict[str, object] = {
    name: getattr(api, "__wrapped__", api)
    for name, api in (("fully_shard", _torch_fully_shard), ("replicate", _torch_replicate))
    if api is not None
}


def _not_served(owner: str, name: str) -> AttributeError:
    return AttributeError(
        f"{owner}.{name}: shardkit's fully_shard serves only the private torch FSDP names "
        "listed in its torch-facing view (docs/notes/018-torch-facing-view.md); use "
        "FSDPModule's public methods (or shardkit.core.register_fsdp_forward_method)"
    )


class _Strict:
    """Any attribute the view does not serve fails by name (``hasattr`` reads False)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names no slot, property or method answers.
        if name.startswith("__"):
            raise AttributeError(name)  # copy, pickle and friends probe dunders
        raise _not_served(type(self).__name__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Slots and settable properties only: a write torch's objects would take but shardkit
        # would ignore fails by name instead.
        try:
            object.__setattr__(self, name, value)
        except AttributeError:
            raise _not_served(type(self).__name__, name) from None


class TorchFacingParam(_Strict, TorchParamFields):
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


class TorchFacingGroup(_Strict):
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
        # Not an AttributeError: a property's would be replaced by _Strict's generic one.
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


class TorchFacingContext(_Strict):
    """The root's context as torch's ``FSDPStateContext`` is read: every state under it."""

    __slots__ = ("_state",)

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[TorchFacingState]:
        """The views of every state under the root (none before the root's lazy init)."""
        ctx = self._state.ctx
        return [] if ctx is None else [view_of(s.modules[0]) for s in ctx.states]


class TorchFacingState(_Strict):
    """One ``fully_shard`` call's ``FSDPState`` as torch's own ``FSDPState`` is read."""

    __slots__ = ("_fsdp_param_groups", "_state", "_state_ctx")

    def __init__(self, state: FSDPState) -> None:
        self._state = state
        self._state_ctx = TorchFacingContext(state)
        # Every group, one per mesh, as torch lists them (``shard_placement_fn`` may return
        # a mesh of a parameter's own).
        self._fsdp_param_groups = [TorchFacingGroup(state, g) for g in state.groups]

    @property
    def state(self) -> FSDPState:
        """The shardkit state behind the view."""
        return self._state

    @property
    def _is_root(self) -> bool | None:
        return self._state.is_root

    @property
    def _fsdp_param_group(self) -> TorchFacingGroup | None:
        groups = self._fsdp_param_groups
        if len(groups) > 1:
            # As torch's: the one group of older code is ambiguous here.
            raise AssertionError(
                f"Expected at most 1 param group for backward compatibility, but got "
                f"{len(groups)} (fqns: {[g._module_fqn for g in groups]}). Use "
                "`_fsdp_param_groups` (plural): shard_placement_fn put parameters on meshes "
                "of their own (ShardPlacementResult)"
            )
        return groups[0] if groups else None

    @property
    def _comm_ctx(self) -> object:
        # Read for its identity (torch 2.15's schedules refuse two stages sharing one): the
        # root's context, the one share_comm_ctx set before the first forward, or, before
        # either, this state (distinct per root, as torch's own contexts are).
        ctx, shared = self._state.ctx, self._state.shared_comm
        return ctx.comm if ctx is not None else shared if shared is not None else self

    # The forward hooks, as torch's FSDPMemTracker swaps them for wrappers and back.

    @property
    def _pre_forward(self) -> Callable[..., Any]:
        return self._state.forward_hooks.pre

    @property
    def _post_forward(self) -> Callable[..., Any]:
        return self._state.forward_hooks.post

    @property
    def _pre_forward_hook_handle(self) -> object:
        return self._state.forward_hooks.pre_handle

    @_pre_forward_hook_handle.setter
    def _pre_forward_hook_handle(self, handle: object) -> None:
        self._state.forward_hooks.pre_handle = handle

    @property
    def _post_forward_hook_handle(self) -> object:
        return self._state.forward_hooks.post_handle

    @_post_forward_hook_handle.setter
    def _post_forward_hook_handle(self, handle: object) -> None:
        self._state.forward_hooks.post_handle = handle

    def _lazy_init(self) -> None:
        self._state.lazy_init()

    def _root_post_backward_final_callback(self) -> None:
        # The end of backward, called by a pipeline schedule outside autograd: the engine's
        # own callback (nothing to do before the root's first forward).
        if self._state.ctx is not None:
            self._state.root_final_callback()


def attach_view(module: nn.Module, state: FSDPState, api: str = "fully_shard") -> None:
    """Keep ``state``'s view on ``module``, where torch's ``<api>.state`` looks."""
    key = _TORCH_KEYS.get(api, api)  # a torch without that API: kept under its name
    view = _views(module).get(key)
    if isinstance(view, TorchFacingState) and view.state is state:
        return  # a list call's modules share one state, hence one view
    states: dict[object, object] = module.__dict__.setdefault(_TORCH_STATE_KEY, {})
    view = states[key] = _view_for(state, module)
    enter_torch_state(module, view, api)  # torch's _get_managed_modules looks there


def _view_for(state: FSDPState, module: nn.Module) -> TorchFacingState:
    for other in state.modules:
        if other is not module:
            view = _find(other)
            if view is not None and view.state is state:
                return view
    return TorchFacingState(state)


def _views(module: nn.Module) -> dict[object, object]:
    found = module.__dict__.get(_TORCH_STATE_KEY)
    return found if isinstance(found, dict) else {}


def _find(module: nn.Module) -> TorchFacingState | None:
    views = _views(module)
    found = (views.get(_TORCH_KEYS.get(api, api)) for api in ("fully_shard", "replicate"))
    return next((v for v in found if isinstance(v, TorchFacingState)), None)


def api_view(module: nn.Module, api: str) -> TorchFacingState | None:
    """The view ``<api>.state(module)`` gives (``api``: fully_shard or replicate), else None."""
    view = _views(module).get(_TORCH_KEYS.get(api, api))
    return view if isinstance(view, TorchFacingState) else None


def view_of(module: nn.Module) -> TorchFacingState:
    """The view of the ``fully_shard`` or ``replicate`` call that manages ``module``.

    Raises:
        RuntimeError: neither of shardkit's APIs manages ``module`` itself.
    """
    view = _find(module)
    if view is None:
        raise RuntimeError(f"{type(module).__name__} is not managed by shardkit's fully_shard")
    return view
