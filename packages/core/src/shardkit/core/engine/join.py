"""Uneven inputs: a root FSDP module under torch's ``Join``, as DDP is.

``with Join([model], optimizer=opt):`` lets ranks run different numbers of iterations. A rank
out of batches enters ``Join.__exit__``, which calls this module's hook once per iteration
that the others still run; the hook shadows that iteration (:class:`FSDPJoinHook`):

1. **Agreement.** Each active rank, at its root's pre-forward, after torch's own
   ``Join.notify_join_context``, all-reduces ``2 + 3 * groups`` int64s over the join group
   (:func:`notify`): a one, whether gradients are enabled (an evaluation's forward has no
   backward to shadow), and per group its ``reduce_grads``, ``all_reduce_grads`` and
   ``is_last_backward``. A joined rank adds zeros, so it learns how many ranks are active
   and whether this iteration reduces gradients and ends with an optimizer step (gradient
   accumulation turns sync off on all but the last micro-batch). Cost, while a Join is
   active only: one small all-reduce per iteration (8 * (2 + 3G) bytes; 256 bytes for ten
   groups) beside torch's notification (one float), which active ranks leave in flight and
   wait on at their next iteration, unless ``divide_by_initial_world_size=False`` needs its
   count before backward. DDP's join pays as much, and blocks on it.
2. **Dry iteration.** The step's collectives with zero gradients (``dry_step``; an
   evaluation's: its forward's gathers and the step check only), over the
   events of this rank's last real iteration (recorded in a ``StepTrace`` while the Join is
   active), or, for a rank that never ran one, the events the module tree gives
   (``step_trace.tree_trace``). The root's lazy init runs first where no forward did.
3. **Optimizer step.** Where the iteration reduced and was the last backward, the shards
   this rank owns hold the others' gradient: ``optimizer.step()`` (then
   ``lr_scheduler.step()``, if given) and ``optimizer.zero_grad()``, as the active ranks do.

A gradient is the sum over the active ranks divided by the initial world size
(``divide_by_initial_world_size=True``, DDP's default), or by the number of active ranks:
each group's divide factor is then scaled for the iteration on every rank, and put back by
the hook's ``post_hook``. ``throw_on_early_termination=True`` is torch's: every rank raises.

A Join counts as active while its config is enabled and the hook it made is alive: torch
never disables the config, but the ``Join`` object, which holds the hook, goes with the
``with`` statement (or the exception it raised), and from then on a forward costs one
lookup and issues nothing. Supported: every iteration runs the same groups in the same order
(the others' order is the recorded one; an evaluation's forward, the forward of a training
iteration), no ``set_manual_backward_finalization`` and no collective outside the engine
(gradient-norm clipping) between forward and the optimizer step. A rank with no batch in this
Join takes the module tree's order, even if it trained before it (recording runs only under a
Join).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.optim.lr_scheduler import LRScheduler

from shardkit.core.engine.dry_step import run_dry_step
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.state_registry import state_of, states_under
from shardkit.core.engine.step_ops import EngineOps
from shardkit.core.engine.step_trace import StepTrace, tree_trace
from shardkit.core.runtime.groups import mesh_group
from shardkit.core.runtime.protocol import CollectiveHandle

if TYPE_CHECKING:
    import torch.distributed as dist

    from shardkit.core.engine.fsdp_state import FSDPState

__all__ = ["NO_JOIN", "FSDPJoinHook", "join_device", "join_hook", "join_process_group", "notify"]

NO_JOIN = _JoinConfig.construct_disabled_join_config()
"""A module's ``_join_config`` until a ``Join`` sets one (what ``Joinable.__init__`` sets)."""

# Each root's live hook, weakly: the Join object holds it, and its end ends the Join.
_HOOKS: weakref.WeakKeyDictionary[FSDPState, weakref.ref[FSDPJoinHook]]
_HOOKS = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class _Agreed:
    """What the active ranks of one iteration agreed (summed over the join group)."""

    active: int
    backward: bool
    """Whether the iteration has a backward (a forward with gradients): else an evaluation's."""
    reduces: list[bool]
    all_reduces: list[bool]
    last: list[bool]

    @staticmethod
    def of(summed: torch.Tensor) -> _Agreed:
        values = [int(v) for v in summed.tolist()]
        flags = values[2:]
        return _Agreed(
            values[0],
            values[1] > 0,
            [v > 0 for v in flags[0::3]],
            [v > 0 for v in flags[1::3]],
            [v > 0 for v in flags[2::3]],
        )

    @property
    def steps(self) -> bool:
        """Whether the active ranks' iteration ends in an optimizer step."""
        return self.backward and any(self.reduces) and all(self.last)


@dataclass(frozen=True, slots=True)
class _InFlight:
    """An active rank's agreement, waited on at its next iteration or at the Join's end."""

    notified: Any
    """torch's ``notify_join_context`` work (None where another joinable notified)."""
    agreement: CollectiveHandle
    summed: torch.Tensor

    def wait(self) -> None:
        if self.notified is not None:
            self.notified.wait()
        self.agreement.wait()


class FSDPJoinHook(JoinHook):
    """The join hook of a root FSDP module: shadow an iteration, then step this rank's shards."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler | None,
        divide_by_initial_world_size: bool,
    ) -> None:
        """Made by :func:`join_hook` (``FSDPModule.join_hook``), which validates the arguments."""
        self.module = module
        self.state = state_of(module)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.groups = [g for s in states_under(module) for g in s.groups]
        self.factors = [g.options.gradient_divide_factor for g in self.groups]
        self.mesh = self.groups[0].mesh_info.mesh
        self.group = mesh_group(self.mesh)
        """The join group: every rank of the root's mesh."""
        self.replay: StepTrace | None = None
        self.last_trace: StepTrace | None = None
        self.pending: _InFlight | None = None

    # --- a rank with a batch ----------------------------------------------------------------

    def active_iteration(self) -> None:
        """This rank runs an iteration: torch's notification, then the agreement (step 1)."""
        self.wait_pending()
        ops = _ops(self.state)
        backward = torch.is_grad_enabled()
        try:
            work = Join.notify_join_context(self.module)  # type: ignore[arg-type]
        except RuntimeError:
            self.restore_factors()  # throw_on_early_termination: this Join ends here
            raise
        flags = [1, int(backward)]  # an evaluation's forward (no gradients) has no backward
        for group in self.groups:
            o = group.options
            flags += [int(o.reduce_grads), int(o.all_reduce_grads), int(o.is_last_backward)]
        vector = torch.tensor(flags, dtype=torch.int64, device=self.state.device)
        handle = _runtime_all_reduce(self.state, vector, self.group)
        self._keep_trace(ops, recording=backward)  # the trace to replay is a training one
        self.pending = _InFlight(work, handle, vector)
        if backward and not self.divide_by_initial_world_size:
            self.wait_pending()  # the reductions of this iteration need the count
            self.set_factors(int(vector[0]))

    def wait_pending(self) -> None:
        """Finish the agreement left in flight by the previous iteration."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def _keep_trace(self, ops: EngineOps, *, recording: bool) -> None:
        if ops.trace is not None and ops.trace.events:
            self.last_trace = ops.trace
        ops.trace = StepTrace() if recording else None

    # --- a joined rank ----------------------------------------------------------------------

    def main_hook(self) -> None:
        """Shadow one iteration of the active ranks (steps 1 to 3 of the module docstring)."""
        state = self.state
        state.lazy_init()
        if not state.is_root:
            raise RuntimeError(f"Join: FSDP module {_name(self.module)} is not the root")
        vector = torch.zeros(2 + 3 * len(self.groups), dtype=torch.int64, device=state.device)
        _runtime_all_reduce(state, vector, self.group).wait()
        agreed = _Agreed.of(vector)
        trace = self._replay_trace(state)
        if not agreed.backward:
            with torch.no_grad():  # an evaluation's forward: its gathers, then the step check
                run_dry_step(state, trace, forward_only=True)
            return
        with self._options_of(agreed):
            run_dry_step(state, trace)
        if agreed.steps:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

    def _replay_trace(self, state: FSDPState) -> StepTrace:
        if self.replay is None:
            ops = _ops(state)
            self._keep_trace(ops, recording=False)
            assert state.ctx is not None
            module = state.modules[0]
            self.replay = self.last_trace or tree_trace(module, state.ctx.states)
        return self.replay

    @contextmanager
    def _options_of(self, agreed: _Agreed) -> Iterator[None]:
        """The active ranks' switches on this rank's groups, for one dry iteration."""
        saved = [
            (o.reduce_grads, o.all_reduce_grads, o.is_last_backward)
            for o in (g.options for g in self.groups)
        ]
        for i, group in enumerate(self.groups):
            o = group.options
            o.reduce_grads, o.all_reduce_grads = agreed.reduces[i], agreed.all_reduces[i]
            o.is_last_backward = agreed.last[i]
        if not self.divide_by_initial_world_size:
            self.set_factors(agreed.active)
        try:
            yield
        finally:
            for group, (reduce, all_reduce, last) in zip(self.groups, saved, strict=True):
                o = group.options
                o.reduce_grads, o.all_reduce_grads, o.is_last_backward = reduce, all_reduce, last

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank joined: finish the agreement in flight, put the divide factors back."""
        self.wait_pending()
        self.restore_factors()
        _HOOKS.pop(self.state, None)
        if self.state.ctx is not None:
            _ops(self.state).trace = None

    # --- both -------------------------------------------------------------------------------

    def set_factors(self, active: int) -> None:
        """Divide by the ``active`` ranks' count instead of every rank's."""
        world = self.mesh.size()
        for group, factor in zip(self.groups, self.factors, strict=True):
            base = factor if factor is not None else float(group.mesh_info.dp_size)
            group.options.gradient_divide_factor = (
                factor if active == world else base * max(active, 1) / world
            )

    def restore_factors(self) -> None:
        """The divide factors the groups had when the Join began."""
        for group, factor in zip(self.groups, self.factors, strict=True):
            group.options.gradient_divide_factor = factor


def join_hook(module: object, **kwargs: Any) -> FSDPJoinHook:
    """``FSDPModule.join_hook``: validate ``Join``'s keyword arguments and make the hook.

    Args:
        module: the root FSDP module.
        **kwargs: ``Join``'s, shared by its joinables: ``optimizer`` (required: each rank
            updates the shards it owns), ``lr_scheduler`` (stepped after it, if given) and
            ``divide_by_initial_world_size`` (default True); others are another joinable's.

    Raises:
        RuntimeError: ``module`` is not managed by ``fully_shard``, or is not a root.
        ValueError: no optimizer, one that does not hold the module's parameters, or a
            module with no parameters.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``lr_scheduler`` no
            ``LRScheduler``.
    """
    assert isinstance(module, nn.Module)
    state = state_of(module)
    name = _name(module)
    if state.is_root is False:
        raise RuntimeError(
            f"Join: FSDP module {name} is not the root; pass the root module (the outermost "
            "fully_shard) to Join"
        )
    optimizer = kwargs.get("optimizer")
    if optimizer is None:
        raise ValueError(
            f"Join([{name}], optimizer=...): FSDP's join hook needs the optimizer, since each "
            "rank updates the shards it owns while the others still train"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Join: optimizer for FSDP module {name} must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    groups = [g for s in states_under(module) for g in s.groups]
    if not groups:
        raise ValueError(f"Join: FSDP module {name} has no sharded parameters")
    _check_optimizer_holds(optimizer, groups, name)
    scheduler = kwargs.get("lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, LRScheduler):
        raise TypeError(
            f"Join: lr_scheduler for FSDP module {name} must be a torch.optim.lr_scheduler."
            f"LRScheduler, got {type(scheduler).__name__}"
        )
    divide = kwargs.get("divide_by_initial_world_size", True)
    hook = FSDPJoinHook(module, optimizer, scheduler, bool(divide))
    _HOOKS[state] = weakref.ref(hook)
    return hook


def _check_optimizer_holds(
    optimizer: torch.optim.Optimizer, groups: list[FSDPParamGroup], name: str
) -> None:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [
        p.fqn
        for g in groups
        for p in g.params
        if p.requires_grad and id(p.sharded_param) not in held
    ]
    if missing:
        raise ValueError(
            f"Join: the optimizer does not hold FSDP module {name}'s parameters "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; a joined rank steps it on them"
        )


def join_device(module: object) -> torch.device:
    """``FSDPModule.join_device``: where Join's counts are all-reduced (the root's device)."""
    assert isinstance(module, nn.Module)
    return state_of(module).device


def join_process_group(module: object) -> dist.ProcessGroup:
    """``FSDPModule.join_process_group``: every rank of the root's mesh."""
    assert isinstance(module, nn.Module)
    groups = [g for s in states_under(module) for g in s.groups]
    if not groups:
        raise ValueError(f"Join: FSDP module {_name(module)} has no sharded parameters")
    return mesh_group(groups[0].mesh_info.mesh)


def notify(state: FSDPState) -> None:
    """The root's pre-forward: tell a live Join this rank runs an iteration (else nothing)."""
    if not _HOOKS:
        return  # no Join was ever made: the common case costs one test
    ref = _HOOKS.get(state)
    if ref is None:
        return
    hook = ref()
    # Join sets it in the instance's dict (as any attribute that is no tensor or module).
    if hook is None or not hook.module.__dict__.get("_join_config", NO_JOIN).enable:
        return
    hook.active_iteration()


def _runtime_all_reduce(
    state: FSDPState, tensor: torch.Tensor, group: dist.ProcessGroup
) -> CollectiveHandle:
    assert state.ctx is not None
    return state.ctx.comm.runtime.all_reduce(tensor, group, label="join")


def _ops(state: FSDPState) -> EngineOps:
    assert state.ctx is not None
    ops = state.ctx.driver.ops
    assert isinstance(ops, EngineOps)
    return ops


def _name(module: nn.Module) -> str:
    fqn = state_of(module).fqn
    return fqn if fqn and fqn != "<root>" else type(module).__name__
