"""State dicts taken from another thread while the training thread runs a step.

See [Note: off-thread state dicts]. A fault-tolerance layer (torchft's quorum thread) calls
``model.state_dict()`` from its own thread while the training thread runs forward and
backward. The training thread's state-dict pre-hook shows the sharded DTensors by
re-registering them on the modules; done from another thread, that swap would pull the
sharded parameters out from under a forward that is reading the full ones (torch's
``fully_shard`` fails so: "got mixed torch.Tensor and DTensor"). So from another thread
nothing is registered: the post-hooks put copies of the sharded DTensors in the state dict,
under the names the full parameters had, and the copies are taken all at once between two
optimizer steps, so every value is of the same step.

Which thread trains is known from the root's pre-forward on (:func:`claim_training_thread`).
A call that began before that, on the training thread's path, may have read the full
parameters the forward registered meanwhile: its post-hooks see the claim and put copies in
place of every value of the call.

Optimizer steps mark themselves through torch's global step hooks: a copy waits for the steps
in flight to end, and a step waits for a copy being taken. A step that raised never reaches
its post-hook; its mark stays until that optimizer steps again, and a copy waiting on it gives
up after ``STEP_WAIT_S`` with an error that says so.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.state_registry import states_under
from shardkit.core.runtime.dtensors import dtensor_like, local_of

__all__ = [
    "STEP_WAIT_S",
    "after_state_dict",
    "before_state_dict",
    "claim_training_thread",
    "install_step_marks",
]

STEP_WAIT_S = 60.0
"""How long an off-thread copy waits for the optimizer steps in flight to end."""

_steps = threading.Condition()
# Optimizers inside step(), by id: the thread that runs each step. Guarded by _steps.
# Weakly keyed: the mark of a step that raised goes with its optimizer, so an optimizer that
# is gone (a failed run's) never holds a later copy back.
_in_step: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_installed = False

# Orders a root's training thread changing (claim_training_thread) against a state-dict
# pre-hook's choice of path and its registering: a pre-hook that chose the training thread's
# path has registered the shards before the claiming forward registers a full parameter.
# Reentrant: whatever a registration sets off on this thread may take a state dict itself.
_claims = threading.RLock()


class _Root(Protocol):
    """What the choice of path reads of a root's context."""

    thread: int | None


class _Group(Protocol):
    """What a state dict reads and registers of a parameter group."""

    @property
    def params(self) -> list[FSDPParam]: ...

    def register_sharded_for_state_dict(self) -> None: ...


class _State(Protocol):
    """What a state dict reads of the state whose module's hook runs."""

    @property
    def ctx(self) -> _Root | None: ...

    @property
    def groups(self) -> Sequence[_Group]: ...


class _Call(threading.local):
    """This thread's state dict call: begun by its first managed module's pre-hook."""

    def __init__(self) -> None:
        self.owner: nn.Module | None = None  # whose post-hook ends the call
        # The prefixes the call gives each module under the owner (by id of the module): a
        # pre-hook that sees another is a new call, after one that raised left this here.
        self.prefixes: dict[int, set[str]] = {}
        # By id of the FSDPParam; None while the call is on the training thread's path.
        self.copies: dict[int, DTensor] | None = None

    def begin(self, owner: nn.Module, prefix: str, copies: dict[int, DTensor] | None) -> None:
        self.owner, self.copies = owner, copies
        self.prefixes = {}
        for path, sub in owner.named_modules(remove_duplicate=False):
            if sub is not owner:
                self.prefixes.setdefault(id(sub), set()).add(f"{prefix}{path}.")

    def inside(self, module: nn.Module, prefix: str) -> bool:
        """Whether ``module``'s hook at ``prefix`` is one of this call's (not a new call's)."""
        return self.owner is not None and prefix in self.prefixes.get(id(module), ())

    def end(self) -> None:
        self.owner, self.copies, self.prefixes = None, None, {}


_CALL = _Call()


def install_step_marks() -> None:
    """Have every optimizer step mark itself in flight (once per process)."""
    global _installed
    with _steps:
        if _installed:
            return
        register_optimizer_step_pre_hook(_step_starts)
        register_optimizer_step_post_hook(_step_ends)
        _installed = True


def _step_starts(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    with _steps:  # waits while a copy is being taken
        _in_step[opt] = threading.get_ident()  # replaces the mark of a step that raised


def _step_ends(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    with _steps:
        _in_step.pop(opt, None)
        _steps.notify_all()


def claim_training_thread(root: _Root) -> None:
    """Make this thread ``root``'s training thread, before it registers any full parameter.

    Called by the root's pre-forward: each step costs one comparison; the lock is taken only
    when the thread changes (the first forward).
    """
    me = threading.get_ident()
    if root.thread != me:
        with _claims:
            root.thread = me


def _off_thread(state: _State) -> bool:
    """Whether this thread is not the training thread of ``state``'s root.

    Before the first forward (no root, or none claimed) nothing is registered full, and the
    training thread's path is safe from any thread.
    """
    root = state.ctx
    return root is not None and root.thread is not None and root.thread != threading.get_ident()


def before_state_dict(state: _State, module: nn.Module, prefix: str) -> None:
    """A managed module's state-dict pre-hook: register its shards, or copy them off-thread.

    On the training thread (or before any forward) the usual path: the groups' sharded
    parameters are registered for ``state_dict`` to read. Off it nothing is registered, and
    the call's first managed module copies the shards of every group under it, at once.
    """
    with _claims:  # the choice and the registering, wholly before or after a claim
        off = _off_thread(state)
        if not off:
            for group in state.groups:
                group.register_sharded_for_state_dict()
    if _CALL.inside(module, prefix):
        return  # a module inside a call that began: its post-hooks put what is needed
    _CALL.begin(module, prefix, _copies_between_steps(_params_under(module)) if off else None)


def after_state_dict(
    state: _State, module: nn.Module, state_dict: dict[str, Any], prefix: str
) -> None:
    """A managed module's state-dict post-hook: the call's copies in place of what was read.

    A call that began on the training thread's path while another thread's forward claimed
    the root since may have read the full parameters that forward registered: the copies are
    taken now, of every group under the call's owner, and the owner's post-hook puts them in
    place of every value the call read (the earlier ones too, so that all are of one step).
    """
    call = _CALL
    owner = call.owner
    if owner is None:
        return
    if call.copies is None:
        # No lock needed: a claim precedes its thread's registering of full parameters, so
        # with none seen here, everything this call read so far was a shard.
        if not _off_thread(state):
            if owner is module:
                call.end()
            return
        call.copies = _copies_between_steps(_params_under(owner))
    params = (
        _params_under(module) if owner is module else [p for g in state.groups for p in g.params]
    )
    _put(module, params, call.copies, state_dict, prefix)
    if owner is module:
        call.end()


def _params_under(module: nn.Module) -> list[FSDPParam]:
    return [p for s in states_under(module) for g in s.groups for p in g.params]


def _copies_between_steps(params: list[FSDPParam]) -> dict[int, DTensor]:
    """Copies of ``params``' shards, taken while no other thread's optimizer step runs."""
    me = threading.get_ident()
    with _steps:
        if not all(t == me for t in _in_step.values()):
            gc.collect()  # an optimizer that raised in its step and is gone, held by a cycle
        # Steps of this very thread cannot end while it waits here: a state dict called from
        # inside a step (a closure) copies what that step has written so far.
        if not _steps.wait_for(
            lambda: all(t == me for t in _in_step.values()), timeout=STEP_WAIT_S
        ):
            raise RuntimeError(
                f"an optimizer step has been in flight for {STEP_WAIT_S:.0f} s: a state dict "
                "from another thread copies the shards between steps (a step that raised "
                "stays in flight until its optimizer steps again)"
            )
        return {id(p): _copy_of(p.sharded_param) for p in params}


def _copy_of(param: torch.Tensor) -> DTensor:
    return dtensor_like(local_of(param).detach().clone(), param)


def _put(
    module: nn.Module,
    params: Iterable[FSDPParam],
    copies: dict[int, DTensor],
    state_dict: dict[str, Any],
    prefix: str,
) -> None:
    """Put the copies of ``params`` where ``module.state_dict`` saved them.

    Each registered name (a tied parameter has several) under ``module`` gets the copy; the
    name of an unlisted parameter is not in the state dict and stays out.
    """
    paths: dict[int, list[str]] = {}  # a module shared at several places has several
    for path, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(f"{prefix}{path}." if path else prefix)
    for p in params:
        copy = copies.get(id(p))
        for slot in p.slots if copy is not None else ():
            for at in paths.get(id(slot.module), ()):
                if f"{at}{slot.name}" in state_dict:
                    state_dict[f"{at}{slot.name}"] = copy
