"""``FullyShardedDataParallel``: FSDP1's wrapper module on shardkit's per-parameter engine.

The wrapper keeps FSDP1's module structure (``_fsdp_wrapped_module``, nested wrappers from
auto-wrapping) and API; underneath, each wrapper's module is one ``fully_shard`` group (see
:mod:`shardkit.legacy.mapping` for the translation). Parameters are the core's sharded
DTensors, one per original parameter, as with ``use_orig_params=True``; with
``use_orig_params=False`` ``named_parameters`` lists one flat parameter per unit instead
(see :mod:`shardkit.legacy.flat_params`).

Next to split off: the root's lazy init and the forward's input casting (the body of
``_lazy_init``, ``_casts_inputs``, ``_cast_floats``), as functions taking the wrapper, into
``wrapper_forward.py``: they read only ``units_in``, ``unit_of`` and the unit's mixed precision,
and the class keeps ``_lazy_init`` and ``forward`` as one-line calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core import FSDPModule
from shardkit.legacy import (
    comm_hooks,
    flat_params,
    grads,
    optim_api,
    settings,
    state_dicts,
    summon,
)
from shardkit.legacy.buffers import cast_buffers
from shardkit.legacy.configs import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from shardkit.legacy.construct import Fsdp1Args, build_unit, own_modules
from shardkit.legacy.orig_params import repoint_optimizers
from shardkit.legacy.raw_state import PLAIN
from shardkit.legacy.torch_compat import (
    FSDP_PREFIX,
    FSDP_WRAPPED_MODULE,
    checkpoint_inner,
    map_tensors,
)
from shardkit.legacy.units import UnitState, register_unit, unit_of, units_in

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel(nn.Module):
    """FSDP1's ``FullyShardedDataParallel``, sharding with shardkit's engine.

    Every argument of FSDP1's constructor is accepted; the package README maps each onto the
    engine, and lists those that no longer change anything (``backward_prefetch``,
    ``forward_prefetch``, ``limit_all_gathers``).

    Args:
        module: the module to shard.
        process_group: the data-parallel group; a pair (intra-node, inter-node) for hybrid
            strategies. Default: every rank.
        sharding_strategy: default ``FULL_SHARD``.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards and gradients on the CPU.
        auto_wrap_policy: which submodules get a wrapper (a group) of their own.
        backward_prefetch: accepted; the engine always prefetches the next group.
        mixed_precision: dtypes of parameters, reductions and buffers.
        ignored_modules: modules whose parameters and buffers are left alone.
        param_init_fn: materializes each module still on the meta device.
        device_id: the compute device (``torch.device("cpu")`` on CPU).
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: accepted; changes nothing.
        limit_all_gathers: accepted; changes nothing (buffers come from a bounded pool).
        use_orig_params: False (FSDP1's default): ``parameters()`` lists one flat 1-D
            parameter per unit, over the unit's flat shard (in the engine's element order).
        ignored_states: parameters or modules to leave alone.
        device_mesh: the data-parallel mesh (2-D for hybrid strategies).
    """

    _fsdp_wrapped_module: nn.Module

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        args = Fsdp1Args(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
        )
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel expects an nn.Module, got {module!r}")
        unit = build_unit(module, args, FullyShardedDataParallel)
        self._fsdp_wrapped_module = module
        flat = None if use_orig_params else flat_params.make_flat(module)
        register_unit(self, UnitState(unit=unit, module=module, flat=flat))
        # Loads through a parent that is not a wrapper (see state_dicts.load_from_parent).
        nn.Module.register_load_state_dict_pre_hook(self, state_dicts.load_from_parent)
        nn.Module.register_load_state_dict_post_hook(self, state_dicts.settle_parent_load)

    # --- FSDP1's attributes ---------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpoint wrapper, the module in it)."""
        return checkpoint_inner(self._fsdp_wrapped_module)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """This unit's sharding strategy."""
        return unit_of(self).unit.strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        """This unit's mixed precision (all ``None`` when there is none)."""
        return unit_of(self).unit.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        """This unit's CPU offloading."""
        return unit_of(self).unit.cpu_offload

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group this unit's parameters are sharded over."""
        return unit_of(self).unit.process_group

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        """FSDP1's argument as given (the engine prefetches the next group in any case)."""
        return unit_of(self).unit.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """FSDP1's argument as given."""
        return unit_of(self).unit.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """FSDP1's argument as given (the engine's buffers come from a bounded pool)."""
        return unit_of(self).unit.limit_all_gathers

    # FSDP1's private attributes that code written for it reads (its own tests among them).
    @property
    def _state_dict_type(self) -> StateDictType:
        """The state-dict type set on this unit (``state_dict_type`` / ``set_...``)."""
        return unit_of(self).settings.state_dict_type

    @property
    def _state_dict_config(self) -> StateDictConfig:
        return unit_of(self).settings.state_dict_config

    @property
    def _optim_state_dict_config(self) -> OptimStateDictConfig:
        return unit_of(self).settings.optim_state_dict_config

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's flat parameter (use_orig_params=False, as FSDP1) or its own parameters."""
        state = unit_of(self)
        ignored = state.unit.ignored_params
        own = own_modules(state.module, set(state.unit.ignored_modules), FullyShardedDataParallel)
        return [p for m in own for p in m.parameters(recurse=False) if p not in ignored]

    @property
    def compute_device(self) -> torch.device:
        """The device forward and backward run on."""
        return unit_of(self).unit.device

    @property
    def rank(self) -> int:
        """This rank's index in ``process_group``."""
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        """The size of ``process_group``."""
        return self.process_group.size()

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped module are the wrapper's, as in FSDP1."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (an ``nn.Sequential``, say)."""
        module: Any = self._fsdp_wrapped_module
        return module[key]

    def check_is_root(self) -> bool:
        """Whether this is the root wrapper (deciding it now if no forward ran yet)."""
        self._lazy_init()
        return bool(unit_of(self).is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The wrappers in ``module``'s tree, itself included (only the outermost: root_only)."""
        return [m for m in units_in(module, root_only) if isinstance(m, FullyShardedDataParallel)]

    # --- forward --------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        state = unit_of(self)
        if state.is_root is not None:
            return
        state.is_root = True
        # Before any step: optimizers built before wrapping get the sharded parameters.
        repoint_optimizers(self)
        for wrapper in units_in(self):
            inner = unit_of(wrapper)
            if wrapper is not self:
                inner.is_root = False
            mp = inner.unit.mixed_precision
            if mp is not None and mp.buffer_dtype is not None:
                ignored = set(inner.unit.ignored_modules)
                modules = own_modules(inner.module, ignored, FullyShardedDataParallel)
                # (a wrapper may ignore its own module: then it casts nothing)
                cast_buffers((m for m in modules if m not in ignored), mp.buffer_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, casting inputs as FSDP1's mixed precision does."""
        self._lazy_init()
        state = unit_of(self)
        if state.is_root:
            flat_params.before_forward(_flats(self))
        mp = state.unit.mixed_precision
        if mp is not None and mp.param_dtype is not None and _casts_inputs(self, state, mp):
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return self._fsdp_wrapped_module(*args, **kwargs)

    # --- FSDP1's methods ------------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters by name; without the wrapper's prefix inside ``summon_full_params``.

        With ``use_orig_params=False`` (outside ``summon_full_params``), each unit's flat
        parameter is what its module registers (``flat_params``), as FSDP1's.
        """
        clean = summon.is_summoned(self)
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers by name; without the wrapper's prefix inside ``summon_full_params``."""
        clean = summon.is_summoned(self)
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buffer

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients without reducing them (on the root only), as FSDP1.

        Raises:
            RuntimeError: called on a wrapper that is not the root.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call "
                "`no_sync()` on root FSDP module."
            )
        modules = [unit_of(w).module for w in units_in(self)]
        cores = [m for m in modules if isinstance(m, FSDPModule)]
        for core in cores:
            core.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for core in cores:
                core.set_requires_gradient_sync(True, recurse=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter to a total norm of ``max_norm``.

        Returns:
            The total norm before clipping, in the gradients' promoted dtype.

        Raises:
            RuntimeError: called on a wrapper that is not the root.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        return grads.clip_grad_norm(self, float(max_norm), float(norm_type))

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``fn`` on every submodule, with full parameters (changes are kept), as FSDP1.

        Returns:
            self.
        """
        with summon.summon_full_params(self, recurse=True, writeback=True):
            _apply_post_order(self, fn)
        return self

    # Full parameters inside a context: FSDP1's signature (see shardkit.legacy.summon).
    summon_full_params = staticmethod(summon.summon_full_params)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Reduce every unit's gradients with ``hook``, as FSDP1 does.

        Call it on the root before the first backward. Sharded units call
        ``hook(state, grad, output)``; ``NO_SHARD`` ones (a unit of one rank is one) call
        ``hook(state, grad)`` (see ``shardkit.legacy.comm_hooks``).

        Raises:
            AssertionError: not the root, a hybrid strategy, a hook already registered.
            ValueError: ``hook`` is not callable.
        """
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        comm_hooks.register_comm_hook(self, state, hook)

    # --- state dicts ----------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state dict of the type set by ``state_dict_type`` (FULL by default)."""
        if not PLAIN.get():
            # As FSDP1, a state dict of a model that never ran initializes it first: buffers
            # take their mixed-precision dtype (and its rounding) as in a forward.
            self._lazy_init()
        return state_dicts.state_dict(self, nn.Module.state_dict, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the type set by ``state_dict_type`` (FULL by default)."""
        self._lazy_init()  # as for state_dict: loaded buffers land in their training dtype
        return state_dicts.load_state_dict(self, state_dict, strict=strict, assign=assign)

    # The state-dict type of a model's wrappers (see shardkit.legacy.settings).
    set_state_dict_type = staticmethod(settings.set_state_dict_type)
    get_state_dict_type = staticmethod(settings.get_state_dict_type)
    state_dict_type = staticmethod(settings.state_dict_type)

    # --- optimizer state (see shardkit.legacy.optim_api) ----------------------------------

    optim_state_dict = staticmethod(optim_api.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_api.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(optim_api.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_api.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_api.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_api.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_api.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_api.rekey_optim_state_dict)


def _flats(root: nn.Module) -> list[flat_params.FlatParam]:
    return [flat for w in units_in(root) if (flat := unit_of(w).flat) is not None]


def _apply_post_order(module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
    # nn.Module.apply's order, without entering inner wrappers' apply (which would gather
    # their parameters again inside this gather).
    for child in module.children():
        _apply_post_order(child, fn)
    fn(module)


def _casts_inputs(wrapper: nn.Module, state: UnitState, mp: MixedPrecision) -> bool:
    if state.is_root:
        # FSDP1 casts the root's inputs when any unit of the model has parameters.
        has_params = any(unit_of(w).unit.has_params for w in units_in(wrapper))
        return has_params and (mp.cast_root_forward_inputs or mp.cast_forward_inputs)
    return state.unit.has_params and mp.cast_forward_inputs


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(cast, tree)
