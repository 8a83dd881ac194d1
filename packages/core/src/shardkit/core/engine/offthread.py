"""State dicts taken from another thread while the training thread runs a step.

See [Note: off-thread state dicts]. A fault-tolerance layer (torchft's quorum thread) calls
``model.state_dict()`` from its own thread while the training thread runs forward and
backward. The training thread's state-dict pre-hook shows the sharded DTensors by
re-registering them on the modules; done from another thread, that swap would pull the
sharded parameters out from under a forward that is reading the full ones (torch's
``fully_shard`` fails so: "got mixed torch.Tensor and DTensor"). So from another thread
nothing is registered: each group's post-hook puts copies of its sharded DTensors in the state
dict, under the names the full parameters had, and the copies are taken all at once between
two optimizer steps, so every value is of the same step.

Optimizer steps mark themselves through torch's global step hooks: a copy waits for the steps
in flight to end, and a step waits for a copy being taken. A step that raised never reaches
its post-hook; its mark stays until that optimizer steps again, and a copy waiting on it gives
up after ``STEP_WAIT_S`` with an error that says so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.dtensors import dtensor_like, local_of

__all__ = ["STEP_WAIT_S", "install_step_marks", "is_off_thread", "put_shards", "take_shards"]

STEP_WAIT_S = 60.0
"""How long an off-thread copy waits for the optimizer steps in flight to end."""

_steps = threading.Condition()
# Optimizers inside step(), by id: the thread that runs each step. Guarded by _steps.
_in_step: dict[int, int] = {}
_installed = False


class _Group(Protocol):
    """What a copy reads of a parameter group."""

    @property
    def params(self) -> list[FSDPParam]: ...


class _Local(threading.local):
    """This thread's copy: taken by the first managed module's pre-hook of a call."""

    def __init__(self) -> None:
        self.copies: dict[int, DTensor] | None = None  # by id of the FSDPParam
        self.owner: nn.Module | None = None  # whose post-hook ends the call
        # The prefixes the call gives each module under the owner (by id of the module): a
        # pre-hook that sees another is a new call, after one that raised left copies here.
        self.prefixes: dict[int, set[str]] = {}


_LOCAL = _Local()


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
        _in_step[id(opt)] = threading.get_ident()  # replaces the mark of a step that raised


def _step_ends(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    with _steps:
        _in_step.pop(id(opt), None)
        _steps.notify_all()


def is_off_thread(training_thread: int | None) -> bool:
    """Whether this thread is not ``training_thread`` (the one that ran the root's forward).

    None (no forward yet): nothing runs a step, and the training thread's path is safe.
    """
    return training_thread is not None and training_thread != threading.get_ident()


def take_shards(module: nn.Module, prefix: str, groups: Iterable[_Group]) -> None:
    """Copy every group's shards for this thread's state dict call on ``module``, at once.

    Called by each managed module's pre-hook; only the first of a call copies. Copies whose
    owner's post-hook never ran (a state dict that raised) are dropped by the next call.
    """
    if _LOCAL.copies is not None and prefix in _LOCAL.prefixes.get(id(module), ()):
        return  # a module inside the call that copied
    owned = [p for group in groups for p in group.params]
    me = threading.get_ident()
    with _steps:
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
        copies = {id(p): _copy_of(p.sharded_param) for p in owned}
    _LOCAL.copies, _LOCAL.owner = copies, module
    _LOCAL.prefixes = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        if sub is not module:
            _LOCAL.prefixes.setdefault(id(sub), set()).add(f"{prefix}{path}.")


def _copy_of(param: torch.Tensor) -> DTensor:
    return dtensor_like(local_of(param).detach().clone(), param)


def put_shards(
    module: nn.Module, params: Iterable[FSDPParam], state_dict: dict[str, Any], prefix: str
) -> None:
    """Put the copies of ``params`` (one group's) where ``module.state_dict`` saved them.

    Each registered name (a tied parameter has several) under ``module`` gets the copy; the
    name of an unlisted parameter is not in the state dict and stays out.
    """
    copies = _LOCAL.copies
    if copies is None:
        return
    paths: dict[int, list[str]] = {}  # a module shared at several places has several
    for path, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(f"{prefix}{path}." if path else prefix)
    for p in params:
        copy = copies.get(id(p))
        for slot in p.slots if copy is not None else ():
            for at in paths.get(id(slot.module), ()):
                if f"{at}{slot.name}" in state_dict:
                    state_dict[f"{at}{slot.name}"] = copy
    if _LOCAL.owner is module:
        _LOCAL.copies, _LOCAL.owner, _LOCAL.prefixes = None, None, {}
