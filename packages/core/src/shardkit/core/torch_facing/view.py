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
whichever function a library imported; and in torch's registry of composable states, as an
instance of torch's ``FSDPState`` (``_ReplicateState`` for ``replicate``), where torch's own
helpers ask whether a module is managed already (``_get_module_fsdp_state``,
``_get_module_replicate_state``, ``_get_managed_modules``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed import _composable_state as _torch_composable_state
from torch.distributed._composable.contract import STATE_KEY as _TORCH_STATE_KEY
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as _TorchFSDPState
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _torch_fully_shard

try:  # torch's replicate on FSDP's engine, and its state class
    from torch.distributed._composable.replicate_with_fsdp import (
        _ReplicateState as _TorchReplicateState,
    )
    from torch.distributed._composable.replicate_with_fsdp import replicate as _torch_replicate
except ImportError:  # a torch without it: nothing reads a replicate state there
    _torch_replicate = None  # type: ignore[assignment]
    _TorchReplicateState = _TorchFSDPState  # type: ignore[assignment,misc]

from shardkit.core.torch_facing.group_view import TorchFacingGroup
from shardkit.core.torch_facing.strict import ShadowsTorchClass, Strict

if TYPE_CHECKING:
    from shardkit.core.engine.fsdp_state import FSDPState

    # For the checker the view is its own class: it serves torch's names with its own types.
    _TorchStateBase = object
    _TorchReplicateBase = object
else:
    _TorchStateBase = _TorchFSDPState
    _TorchReplicateBase = _TorchReplicateState

__all__ = [
    "TorchFacingContext",
    "TorchFacingReplicateState",
    "TorchFacingState",
    "api_view",
    "attach_view",
    "view_of",
]

# The keys torch's decorator files each API's state under: the undecorated function.
_TORCH_KEYS: dict[str, object] = {
    name: getattr(api, "__wrapped__", api)
    for name, api in (("fully_shard", _torch_fully_shard), ("replicate", _torch_replicate))
    if api is not None
}


class TorchFacingContext(Strict):
    """The root's context as torch's ``FSDPStateContext`` is read: every state under it."""

    __slots__ = ("_state",)

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[TorchFacingState]:
        """The views of every state under the root (none before the root's lazy init)."""
        ctx = self._state.ctx
        return [] if ctx is None else [view_of(s.modules[0]) for s in ctx.states]


class TorchFacingState(ShadowsTorchClass, _TorchStateBase):
    """One ``fully_shard`` call's ``FSDPState`` as torch's own ``FSDPState`` is read.

    An instance of torch's ``FSDPState`` too, filed in torch's registry of composable states
    (see :func:`attach_view`): torch's ``_get_module_fsdp_state`` finds it, so torch's
    helpers (``_get_managed_modules``) see shardkit's modules as managed. Torch's own methods
    are not inherited: each name not served here fails by name (strict.py).
    """

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
    def _modules_to_run_forward(self) -> set[nn.Module]:
        """A list call's modules whose forward has yet to run in this pass (a copy).

        Always empty for a call of one module, as torch's, whose hooks are not a list's.
        """
        state = self._state
        return set(state.forward_pending) if len(state.modules) > 1 else set()

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


class TorchFacingReplicateState(TorchFacingState, _TorchReplicateBase):
    """One ``replicate`` call's state, as torch's ``_ReplicateState`` is read.

    An instance of torch's ``_ReplicateState`` too, so that torch's
    ``_get_module_replicate_state`` (its pipelining stage's check) finds it.
    """

    __slots__ = ()


def attach_view(module: nn.Module, state: FSDPState, api: str = "fully_shard") -> None:
    """Keep ``state``'s view on ``module``, where torch's ``<api>.state`` looks.

    ``api``: ``"fully_shard"`` or ``"replicate"``, the call that made ``state``.
    """
    key = _TORCH_KEYS.get(api, api)  # a torch without that API: kept under its name
    view = _views(module).get(key)
    if isinstance(view, TorchFacingState) and view.state is state:
        return  # a list call's modules share one state, hence one view
    states: dict[object, object] = module.__dict__.setdefault(_TORCH_STATE_KEY, {})
    states[key] = view = _view_for(state, module, api)
    _file_composable_state(module, view)


def _file_composable_state(module: nn.Module, view: TorchFacingState) -> None:
    # Torch's composable APIs look a module's state up in a registry of their own (torch's
    # fully_shard files its states there at init): filed there, the view answers torch's
    # _get_module_fsdp_state. A live state of another API stays.
    registry = _torch_composable_state._module_state_mapping
    filed = registry.get(module)
    other = filed() if filed is not None else None
    if other is None or isinstance(other, TorchFacingState):
        # A torch FSDPState at run time (the checker sees the view's own class).
        registry[module] = weakref.ref(view)  # type: ignore[arg-type]


def _view_for(state: FSDPState, module: nn.Module, api: str) -> TorchFacingState:
    for other in state.modules:
        if other is not module:
            view = _find(other)
            if view is not None and view.state is state:
                return view
    return TorchFacingReplicateState(state) if api == "replicate" else TorchFacingState(state)


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
