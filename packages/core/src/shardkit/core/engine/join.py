"""Uneven inputs: a root FSDP module under torch's ``Join``, as DDP is.

``with Join([model], optimizer=opt):`` lets ranks run different numbers of iterations. A rank
out of batches enters ``Join.__exit__``, whose loop calls each joinable's hook once per
iteration the others still run (torch's count of active ranks first). This module's hook
shadows the iteration by what the active ranks announce to it, in small all-reduces over the
mesh (``engine/join_message``), and returns at the iteration's step, so a ``Joinable`` listed
after the model shadows what the program issues after the step, as torch's pattern has it.
The active ranks announce (the arguments ``Join`` passes are checked by ``engine/join_args``):

1. **An iteration** (``ITERATION``, :func:`notify`, at the root's pre-forward, after torch's
   own ``Join.notify_join_context``): a one, whether gradients are enabled (an evaluation's
   forward has no backward to shadow), and per group its ``reduce_grads``,
   ``all_reduce_grads`` and ``is_last_backward``. A joined rank adds zeros, so it learns how
   many ranks are active and whether the iteration reduces gradients (gradient accumulation
   turns sync off on all but the last micro-batch). It shadows the iteration: the step's
   collectives with zero gradients (``dry_step``; an evaluation's: its forward's gathers and
   the step check only), over the events of this rank's last real iteration (recorded in a
   ``StepTrace`` while the Join is active), or, for a rank that never ran one, the events the
   module tree gives (``step_trace.tree_trace``). The root's lazy init runs first where no
   forward did. The active ranks wait for it before their forward: they must know whether a
   rank is out of batches before the iteration's own code runs.
2. **A gradient norm** (``NORM``), before its all-reduce goes out, in an iteration that steps
   (the joined rank listens, after its dry iteration, until the step): the joined rank computes
   the same norm over its shards (``torch.nn.utils.get_total_norm``), which hold its part of
   the averaged gradient, so the norm is the averaged gradient's on every rank.
3. **An optimizer step** (``STEP``), from the optimizer's step pre-hook, with the factor each
   gradient was scaled by since the backward (gradient clipping): the joined rank scales its
   shards alike, then ``optimizer.step()`` (then ``lr_scheduler.step()``, if given) and
   ``optimizer.zero_grad()``.
4. **Something it cannot shadow** (``FOREIGN``): every rank raises the same error.

Announcements 2 to 4 happen only while some rank is out of batches; the active ranks then run
under a :class:`~shardkit.core.runtime.watch.collective_watch.CollectiveWatch` (``engine/
join_watch``), which sees the norms, the scaling, and any other collective before it goes
out. Such a collective (unless a method of another ``Joinable`` issues it) is held back (its
caller sees its tensors unchanged) and named at the next announcement (the step, or the next
iteration, which then opens with ``FOREIGN``), where every rank raises; one still held at the
Join's end is named by the exchange of the hooks' ``post_hook``. A watch left behind by an
exception in the loop lets everything pass and is dropped at the root's next forward.

A gradient is the sum over the active ranks divided by the initial world size
(``divide_by_initial_world_size=True``, DDP's default), or by the number of active ranks:
each group's divide factor is then scaled for the iteration on every rank, and put back by
the hook's ``post_hook``. ``throw_on_early_termination=True`` is torch's: every rank raises.

A Join counts as active while its config is enabled and the hook it made is alive: torch
never disables the config, but the ``Join`` object, which holds the hook, goes with the
``with`` statement (or the exception it raised), and from then on a forward costs one
lookup and issues nothing. Supported: every iteration runs the same groups in the same order
(the others' order is the recorded one; an evaluation's forward, the forward of a training
iteration), and no ``set_manual_backward_finalization``. A rank with no batch in this Join
takes the module tree's order, even if it trained before it (recording runs only under a
Join).

Next to split off: the groups' switches for one iteration (``_options_of``, ``set_factors``,
``restore_factors``, the flags ``active_iteration`` announces), as a helper object the hook
holds, into ``join_groups.py``: it reads and writes only the groups' options and divide
factors, and sends none of the messages.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.optim.lr_scheduler import LRScheduler

from shardkit.core.engine.dry_step import run_dry_step
from shardkit.core.engine.join_args import join_args, root_name
from shardkit.core.engine.join_message import (
    NAME_SLOTS,
    Kind,
    Message,
    decode_name,
    encode_name,
    header_size,
    norm_body,
    unshadowable_message,
)
from shardkit.core.engine.join_watch import (
    GradNorm,
    JoinWatchPolicy,
    scale_grads,
    shadow_norm,
    watch_steps,
)
from shardkit.core.engine.root_context import RootState
from shardkit.core.engine.state_registry import state_of, states_under
from shardkit.core.engine.step_ops import EngineOps
from shardkit.core.engine.step_trace import StepTrace, tree_trace
from shardkit.core.runtime.groups import mesh_group
from shardkit.core.runtime.protocol import CollectiveHandle
from shardkit.core.runtime.watch.collective_watch import CollectiveWatch, drop_orphaned_watch

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["NO_JOIN", "FSDPJoinHook", "join_device", "join_hook", "join_process_group", "notify"]

NO_JOIN = _JoinConfig.construct_disabled_join_config()
"""A module's ``_join_config`` until a ``Join`` sets one (what ``Joinable.__init__`` sets)."""

# Each root's live hook, weakly: the Join object holds it, and its end ends the Join.
_HOOKS: weakref.WeakKeyDictionary[RootState, weakref.ref[FSDPJoinHook]]
_HOOKS = weakref.WeakKeyDictionary()


class FSDPJoinHook(JoinHook):
    """The join hook of a root FSDP module: shadow the others' turns, step this rank's shards."""

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
        self.params = [p.sharded_param for g in self.groups for p in g.params if p.requires_grad]
        self.mesh = self.groups[0].mesh_info.mesh
        self.group = mesh_group(self.mesh)
        """The join group: every rank of the root's mesh."""
        self.replay: StepTrace | None = None
        self.last_trace: StepTrace | None = None
        # The step hooks and the watch hold this hook weakly: its life is the Join's.
        self.policy = JoinWatchPolicy(weakref.proxy(self), self.params)
        self.watch = CollectiveWatch(self.policy)
        self.step_hooks = watch_steps(optimizer, self)
        self.listening = False
        """An active rank's: whether the joined ranks listen for announcements now."""
        self.step_depth = 0

    # --- a rank with a batch ----------------------------------------------------------------

    def active_iteration(self) -> None:
        """This rank runs an iteration: announce it (a turn), watch it if a rank has joined."""
        self.watch.stop()
        if self.policy.unshadowable is not None:
            self.raise_unshadowable(turn=not self.listening)  # held in the previous iteration
        if self.listening:  # the previous iteration did not step: the joined ranks skip it too
            self.announce(Kind.NO_STEP, [], turn=False)
            self.listening = False
        ops = _ops(self.state)
        backward = torch.is_grad_enabled()
        flags = [float(backward)]  # an evaluation's forward (no gradients) has no backward
        for group in self.groups:
            o = group.options
            flags += [float(o.reduce_grads), float(o.all_reduce_grads), float(o.is_last_backward)]
        message = Message.of(self.announce(Kind.ITERATION, flags, turn=True))
        self._keep_trace(ops, recording=backward)  # the trace to replay is a training one
        if backward and not self.divide_by_initial_world_size:
            self.set_factors(message.active)  # the reductions of this iteration need the count
        # A joined rank listens, after its dry iteration, until this iteration's step.
        self.listening = message.active < self.mesh.size() and message.steps
        if message.active < self.mesh.size():
            self.policy.begin_iteration()
            self.watch.start()

    def announce(
        self, kind: Kind, body: list[float], payload: torch.Tensor | None = None, *, turn: bool
    ) -> torch.Tensor:
        """Send ``kind``; a ``turn`` opens one of the joined ranks' loop (torch's notification)."""
        work = None
        if turn:
            try:
                work = Join.notify_join_context(self.module)  # type: ignore[arg-type]
            except RuntimeError:
                self.restore_factors()  # throw_on_early_termination: this Join ends here
                self.watch.stop()
                raise
        header = Message.header(kind, body, len(self.groups)).to(self.state.device)
        _runtime_all_reduce(self.state, header, self.group).wait()
        if work is not None:
            work.wait()
        if payload is not None:
            _runtime_all_reduce(self.state, payload.to(self.state.device), self.group).wait()
        return header

    def announce_norm(self, norm: GradNorm) -> bool:
        """A norm over gradients is about to be all-reduced: whether it may go out."""
        if not self.listening:
            self.policy.unshadowable = "a gradient norm in an iteration that does not step"
            return False
        if self.policy.unshadowable is not None:
            self.raise_unshadowable(turn=False)
        covers = torch.tensor(norm.covers, dtype=torch.float64)
        self.announce(Kind.NORM, norm_body(norm.norm_type, norm.foreach), covers, turn=False)
        return True

    def before_step(self) -> None:
        """The optimizer is about to step on an active rank: the joined ranks step too."""
        self.step_depth += 1
        # An optimizer subclass whose step calls its parent's runs the hooks twice, nested.
        if not self.watch.started or self.step_depth > 1:
            return  # no rank out of batches, this rank is the joined one, or a nested step
        if not self.listening:
            self.policy.unshadowable = "optimizer.step() in an iteration that reduced no gradients"
        if self.policy.unshadowable is not None:
            self.raise_unshadowable(turn=not self.listening)
        scales = torch.tensor(self.policy.scales, dtype=torch.float64)
        self.announce(Kind.STEP, [], scales, turn=False)
        self.listening = False
        self.policy.stepping = True

    def after_step(self) -> None:
        """The optimizer stepped: what the watch kept starts again."""
        self.step_depth = max(self.step_depth - 1, 0)
        if self.policy.stepping and self.step_depth == 0:
            self.policy.stepping = False
            self.policy.begin_iteration()

    def raise_unshadowable(self, *, turn: bool) -> None:
        """Name what the joined ranks cannot shadow to them, then raise it here too.

        ``turn``: at an iteration's start (a turn of their loop), else while they listen.
        """
        name = self.policy.unshadowable
        assert name is not None
        self.announce(Kind.FOREIGN, [], encode_name(name), turn=turn)
        self.watch.stop()
        self.policy.unshadowable = None
        self.listening, self.step_depth = False, 0
        raise RuntimeError(unshadowable_message(name, root_name(self.module)))

    def _keep_trace(self, ops: EngineOps, *, recording: bool) -> None:
        if ops.trace is not None and ops.trace.events:
            self.last_trace = ops.trace
        ops.trace = StepTrace() if recording else None

    # --- a joined rank ----------------------------------------------------------------------

    def main_hook(self) -> None:
        """Shadow one iteration of the active ranks (see the module docstring)."""
        state = self.state
        state.lazy_init()
        if not state.is_root:
            raise RuntimeError(f"Join: FSDP module {root_name(self.module)} is not the root")
        self.watch.stop()  # this rank was active until now
        iteration = self._listen()
        self._shadow_iteration(iteration)
        while iteration.steps:  # what the active ranks announce until their step
            message = self._listen()
            if message.kind is Kind.NORM:
                covers = self._payload(len(self.params)).gt(0.5 * message.active).tolist()
                shadow_norm(self.params, covers, message.norm_type, message.foreach)
            elif message.kind is Kind.STEP:
                self._shadow_step((self._payload(len(self.params)) / message.active).tolist())
                return
            elif message.kind is Kind.NO_STEP:  # as a skipped step's loop goes on: zero_grad()
                self.optimizer.zero_grad(set_to_none=True)
                return
            else:
                raise AssertionError(f"Join: {message.kind.name} announced before the step")

    def _listen(self) -> Message:
        """The active ranks' next message (raising what they could not let this rank shadow)."""
        header = torch.zeros(header_size(len(self.groups)), dtype=torch.float64)
        header = header.to(self.state.device)
        _runtime_all_reduce(self.state, header, self.group).wait()
        message = Message.of(header)
        if message.kind is Kind.FOREIGN:
            name = decode_name(self._payload(NAME_SLOTS), message.active)
            raise RuntimeError(unshadowable_message(name, root_name(self.module)))
        return message

    def _payload(self, size: int) -> torch.Tensor:
        payload = torch.zeros(size, dtype=torch.float64, device=self.state.device)
        _runtime_all_reduce(self.state, payload, self.group).wait()
        return payload.cpu()

    def _shadow_iteration(self, message: Message) -> None:
        assert message.kind is Kind.ITERATION, f"Join: {message.kind.name} opened a turn"
        trace = self._replay_trace(self.state)
        if not message.backward:
            with torch.no_grad():  # an evaluation's forward: its gathers, then the step check
                run_dry_step(self.state, trace, forward_only=True)
            return
        with self._options_of(message):
            run_dry_step(self.state, trace)

    def _shadow_step(self, scales: list[float]) -> None:
        """The active ranks' optimizer step, on gradients scaled as theirs were."""
        scale_grads(self.params, scales)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _replay_trace(self, state: RootState) -> StepTrace:
        if self.replay is None:
            ops = _ops(state)
            self._keep_trace(ops, recording=False)
            assert state.ctx is not None
            module = state.modules[0]
            self.replay = self.last_trace or tree_trace(module, state.ctx.states)
        return self.replay

    @contextmanager
    def _options_of(self, message: Message) -> Iterator[None]:
        """The active ranks' switches on this rank's groups, for one dry iteration."""
        saved = [
            (o.reduce_grads, o.all_reduce_grads, o.is_last_backward)
            for o in (g.options for g in self.groups)
        ]
        reduces, all_reduces, last = (message.flags(i) for i in range(3))
        for i, group in enumerate(self.groups):
            o = group.options
            o.reduce_grads, o.all_reduce_grads = reduces[i], all_reduces[i]
            o.is_last_backward = last[i]
        if not self.divide_by_initial_world_size:
            self.set_factors(message.active)
        try:
            yield
        finally:
            for group, (reduce, all_reduce, last_) in zip(self.groups, saved, strict=True):
                o = group.options
                o.reduce_grads, o.all_reduce_grads, o.is_last_backward = reduce, all_reduce, last_

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank joined: name anything still held back, put the divide factors back."""
        self.watch.stop()
        self.restore_factors()
        _HOOKS.pop(self.state, None)
        for handle in self.step_hooks:
            handle.remove()
        if self.state.ctx is not None:
            _ops(self.state).trace = None
        # An active rank's last iteration may have held a collective back: every rank learns.
        held = self.policy.unshadowable
        self.policy.unshadowable = None
        names = torch.cat([torch.tensor([float(held is not None)]), encode_name(held or "")])
        names = names.to(dtype=torch.float64, device=self.state.device)
        _runtime_all_reduce(self.state, names, self.group).wait()
        count = round(float(names[0]))
        if count:
            name = decode_name(names[1:].cpu(), count)
            raise RuntimeError(unshadowable_message(name, root_name(self.module)))

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

    See :func:`~shardkit.core.engine.join_args.join_args` for the arguments and the errors.
    """
    assert isinstance(module, nn.Module)
    args = join_args(module, kwargs)
    hook = FSDPJoinHook(
        module, args.optimizer, args.lr_scheduler, args.divide_by_initial_world_size
    )
    _HOOKS[state_of(module)] = weakref.ref(hook)
    return hook


def join_device(module: object) -> torch.device:
    """``FSDPModule.join_device``: where Join's counts are all-reduced (the root's device)."""
    assert isinstance(module, nn.Module)
    return state_of(module).device


def join_process_group(module: object) -> dist.ProcessGroup:
    """``FSDPModule.join_process_group``: every rank of the root's mesh."""
    assert isinstance(module, nn.Module)
    groups = [g for s in states_under(module) for g in s.groups]
    if not groups:
        raise ValueError(f"Join: FSDP module {root_name(module)} has no sharded parameters")
    return mesh_group(groups[0].mesh_info.mesh)


def notify(state: RootState) -> None:
    """The root's pre-forward: tell a live Join this rank runs an iteration (else nothing)."""
    if not _HOOKS:
        return  # no Join was ever made: the common case costs one test
    ref = _HOOKS.get(state)
    if ref is None:
        return
    hook = ref()
    # Join sets it in the instance's dict (as any attribute that is no tensor or module).
    if hook is None or not hook.module.__dict__.get("_join_config", NO_JOIN).enable:
        drop_orphaned_watch()  # a Join that ended by an exception while a rank was joined
        return
    hook.active_iteration()


def _runtime_all_reduce(
    state: RootState, tensor: torch.Tensor, group: dist.ProcessGroup
) -> CollectiveHandle:
    assert state.ctx is not None
    return state.ctx.comm.runtime.all_reduce(tensor, group, label="join")


def _ops(state: RootState) -> EngineOps:
    assert state.ctx is not None
    ops = state.ctx.driver.ops
    assert isinstance(ops, EngineOps)
    return ops
