"""Where a program is: which module runs, in which phase, in which step. Works on any torch program.

Seen through public, process-wide hooks only, so it needs no knowledge of the model or of the
data-parallel wrapper:

- forward: global module forward pre- and post-hooks (a stack of running modules);
- backward: a gradient hook on each module's outputs marks the start of that module's
  backward, one on its inputs the end; an autograd final callback closes the phase;
- optimizer: global optimizer step pre- and post-hooks; a completed step of the first
  optimizer seen advances the step counter.

Module names are fully qualified from the outermost module that ran (wrapper prefixes such as
FSDP1's ``_fsdp_wrapped_module.`` and DDP's ``module.`` are dropped, so the same model has the
same names under every wrapper). Listeners are told of every change.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.tools.records import Phase, PhaseSpan

__all__ = ["ModuleScope", "ScopeChange"]

# Path segments wrappers insert between a module and its children.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


@dataclass(frozen=True, slots=True)
class ScopeChange:
    """What a listener is told: the scope after a change, and what changed."""

    what: str
    """'enter' or 'exit' (a module's phase), 'forward_end', 'backward_end' or 'step'."""
    module: str
    phase: Phase
    t_s: float


def _clean_name(name: str, root: nn.Module) -> str:
    parts = [p for p in name.split(".") if p and p not in _WRAPPER_SEGMENTS]
    if isinstance(root, nn.parallel.DistributedDataParallel) and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


@dataclass(slots=True)
class _Frame:
    module: str
    phase: Phase
    start_s: float


class ModuleScope:
    """Tracks the running module and phase while started (not re-entrant; one per tracker set)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()
        """The same instant as ``t0`` on the wall clock, to line ranks up."""
        self.step = 0
        self.spans: list[PhaseSpan] = []
        self.forward_ends: list[float] = []
        """Times (s) at which the outermost forward returned."""
        self.step_ends: list[float] = []
        """Times (s) at which each counted optimizer step returned."""
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> fqn
        self._forward: list[_Frame] = []
        self._backward: list[_Frame] = []
        self._in_backward = False
        self._optimizer: _Frame | None = None
        self._step_owner: weakref.ref[torch.optim.Optimizer] | None = None
        self._handles: list[RemovableHandle] = []
        self._listeners: list[Callable[[ScopeChange], None]] = []
        self._here: tuple[str, Phase] | None = None  # current(), until the next change

    def now(self) -> float:
        """Seconds since this scope was created."""
        return time.perf_counter() - self.t0

    def modules(self) -> list[nn.Module]:
        """Every module seen running so far (with all the modules in its tree)."""
        return list(self._names.keys())

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every module seen so far, named as in the records."""
        return [(name, module) for module, name in self._names.items()]

    def add_listener(self, listener: Callable[[ScopeChange], None]) -> None:
        """Call ``listener`` on every change of module, phase or step."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Install the global hooks."""
        if self._handles:
            raise RuntimeError("ModuleScope is already started")
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            nn.modules.module.register_module_forward_hook(self._post_forward, always_call=True),
            register_optimizer_step_pre_hook(self._pre_step),
            register_optimizer_step_post_hook(self._post_step),
        ]

    def stop(self) -> None:
        """Remove the hooks; spans still open are closed now."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        end = self.now()
        for frame in [*self._backward, *self._forward]:
            self._close(frame, end)
        self._forward, self._backward = [], []
        self._in_backward, self._optimizer, self._here = False, None, None

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass is running."""
        return self._in_backward

    def current(self) -> tuple[str, Phase]:
        """The innermost running module ('' for none) and the phase."""
        # Asked for at every allocation by MemoryTracker: cached until the next change.
        if self._here is None:
            self._here = self._find_current()
        return self._here

    def _find_current(self) -> tuple[str, Phase]:
        if self._optimizer is not None:
            return "", Phase.OPTIMIZER
        if self._in_backward:
            return (self._backward[-1].module if self._backward else ""), Phase.BACKWARD
        if self._forward:
            return self._forward[-1].module, Phase.FORWARD
        return "", Phase.OTHER

    # -- forward ---------------------------------------------------------------------------

    def _learn_names(self, root: nn.Module) -> None:
        for name, module in root.named_modules(remove_duplicate=False):
            if module not in self._names:
                self._names[module] = _clean_name(name, root)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if module not in self._names:
            self._learn_names(module)
        name = self._names[module]
        self._enter(_Frame(name, Phase.FORWARD, self.now()), self._forward)
        if torch.is_grad_enabled():
            # The gradients of a module's inputs are its backward's last result.
            for tensor in _tensors(args):
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_exit_hook(name))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._forward:
            return
        frame = self._forward.pop()
        self._close(frame, self.now())
        if not self._forward:
            self.forward_ends.append(self.now())
            self._notify("forward_end", "", Phase.OTHER)
        else:
            self._notify("exit", self._forward[-1].module, Phase.FORWARD)
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_enter_hook(frame.module))

    # -- backward --------------------------------------------------------------------------

    def _backward_enter_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_soon)
            if self._backward and self._backward[-1].module == name:
                return  # a second output of the same module
            self._enter(_Frame(name, Phase.BACKWARD, self.now()), self._backward)

        return hook

    def _backward_exit_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            for i in range(len(self._backward) - 1, -1, -1):
                if self._backward[i].module == name:
                    end = self.now()
                    for frame in self._backward[i:]:
                        self._close(frame, end)
                    del self._backward[i:]
                    parent = self._backward[-1].module if self._backward else ""
                    self._notify("exit", parent, Phase.BACKWARD)
                    return

        return hook

    def _end_backward_soon(self) -> None:
        # Queued at the start of backward, this runs before callbacks queued later (FSDP's
        # own final callback among them); queueing once more puts the end after those.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        end = self.now()
        for frame in self._backward:
            self._close(frame, end)
        self._backward = []
        self._in_backward = False
        self._notify("backward_end", "", Phase.OTHER)

    # -- optimizer -------------------------------------------------------------------------

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step_owner is None or self._step_owner() is None:
            self._step_owner = weakref.ref(optimizer)
        if self._optimizer is None:
            self._optimizer = _Frame("", Phase.OPTIMIZER, self.now())
            self._notify("enter", "", Phase.OPTIMIZER)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step_owner is None or self._step_owner() is not optimizer:
            return
        if self._optimizer is not None:
            self._close(self._optimizer, self.now())
            self._optimizer = None
        self.step += 1
        self.step_ends.append(self.now())
        self._notify("step", "", Phase.OTHER)

    # -- bookkeeping -----------------------------------------------------------------------

    def _enter(self, frame: _Frame, stack: list[_Frame]) -> None:
        stack.append(frame)
        self._notify("enter", frame.module, frame.phase)

    def _close(self, frame: _Frame, end: float) -> None:
        self.spans.append(
            PhaseSpan(
                module=frame.module,
                phase=frame.phase,
                start_s=frame.start_s,
                end_s=end,
                step=self.step,
            )
        )

    def _notify(self, what: str, module: str, phase: Phase) -> None:
        self._here = None  # every change of module or phase comes through here
        if self._listeners:
            change = ScopeChange(what, module, phase, self.now())
            for listener in self._listeners:
                listener(change)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors directly inside a module's args or output (tuples, lists, dict values)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
