"""MemoryTracker: live tensor memory by category, per module and phase, on any torch program.

How it sees memory (see [Note: observing torch programs] in docs/notes/004):

- A dispatch mode sees the output of every operator: each new storage is logged with the
  module and phase it appeared in; a weak reference logs its free.
- ``UntypedStorage.resize_`` is wrapped while tracking, since FSDP engines (torch's and ours)
  grow and free unsharded storages by resizing, which no operator reports.
- Categories come from what a storage is seen to be: the modules' parameters when first seen
  (sharded parameters), a running module's other parameters (unsharded parameters),
  ``.grad`` of the optimizer's parameters and gradients computed for a parameter in backward
  (gradients), the optimizer's state, tensors handed to collectives (communication buffers);
  the rest is an activation if made in forward and alive after it, else "other".

Memory that exists before tracking starts is counted only for what is found through the
modules and the optimizer (parameters, gradients, optimizer state).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from shardkit.tools.records import Category, MemoryReport, MemorySample, Phase
from shardkit.tools.track.memory_replay import Replay
from shardkit.tools.track.scope import ModuleScope, ScopeChange
from shardkit.tools.track.storage_ledger import (
    StorageLedger,
    Where,
    has_own_storage,
    keeps_own_storage,
)
from shardkit.tools.track.tracking import LightDispatchMode, MethodWrap, Tracker

__all__ = ["MemoryTracker"]

_NO_SHAPES: frozenset[tuple[int, ...]] = frozenset()


def _logged_resize(original: Any, ledgers: list[StorageLedger]) -> Any:
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        for active in tuple(ledgers):
            active.resized(storage)
        return result

    return resize_


_RESIZE_WRAP: MethodWrap[StorageLedger] = MethodWrap(
    torch.UntypedStorage, "resize_", _logged_resize
)


class _Dispatch(LightDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        # Runs for every operator: the common case is kept to a few cheap tests, inline.
        for kind in types:
            if kind is not torch.Tensor and not keeps_own_storage(kind):
                # A wrapper subclass's op (DTensor's, in FSDP's optimizer step): its outputs
                # hold no storage of their own, and its local ops are not ours to see.
                return out
        tracker = self.tracker
        is_comm = self.is_comm(func)
        if not is_comm and type(out) is torch.Tensor and not tracker.scope.in_backward:
            # One plain tensor out, outside backward: very often a view of a known storage.
            storage = out.untyped_storage()
            if not tracker.ledger.knows(storage) and not out.is_meta:
                tracker.ledger.track(storage)
            return out
        tracker._on_op(args, kwargs or {}, out, is_comm)
        return out


class MemoryTracker(Tracker):
    """Live tensor memory of this process, by category, module and phase.

    Use as a context manager around training steps::

        with MemoryTracker(model, optimizer) as mem:
            train_step()
        peak_by_category = mem.report().peak.by_category

    Args:
        modules: the models to attribute parameters to (found by themselves on their first
            forward otherwise).
        optimizers: optimizers whose state to count (found on their first step otherwise).
        device: the device whose memory to track ('cpu' or 'cuda'); by default the device of
            the first parameter of ``modules``, else 'cpu'.
        scope: a :class:`ModuleScope` shared with other trackers; by default its own.
    """

    def __init__(
        self,
        *modules: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        device: str | None = None,
        scope: ModuleScope | None = None,
    ) -> None:
        self._modules = list(modules)
        self._optimizers = list(optimizers)
        if device is None:
            first = next((p for m in self._modules for p in m.parameters()), None)
            device = first.device.type if first is not None else "cpu"
        self.device = device
        self._own_scope = scope is None
        self.scope = scope if scope is not None else ModuleScope()
        self.ledger = StorageLedger(device, self._where)
        self.replay = Replay()
        self._mode: _Dispatch | None = None
        self._handles: list[RemovableHandle] = []
        self._seen_modules: set[int] = set()
        # id(autograd node) -> (the node, kept so its id is not reused; parameter shapes)
        self._grad_shapes: dict[int, tuple[Any, set[tuple[int, ...]]]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> MemoryTracker:
        """Start tracking (what ``with`` does)."""
        if self._mode is not None:
            raise RuntimeError("MemoryTracker is already running")
        if self._own_scope:
            self.scope.start()
        self.scope.add_listener(self._on_scope)
        for module in self._modules:
            self._learn_module(module)
        for optimizer in self._optimizers:
            self._learn_optimizer(optimizer)
        self._handles = [
            register_optimizer_step_pre_hook(lambda opt, a, k: self._learn_optimizer(opt)),
            register_optimizer_step_post_hook(lambda opt, a, k: self._learn_optimizer(opt)),
            nn.modules.module.register_module_forward_pre_hook(self._on_forward),
            nn.modules.module.register_module_forward_hook(self._after_forward),
        ]
        _RESIZE_WRAP.add(self.ledger)
        self._mode = _Dispatch(self)
        self._mode.enter()
        return self

    def stop(self) -> None:
        """Stop tracking; the report stays available."""
        if self._mode is None:
            return
        self._mode.exit()
        self._mode = None
        _RESIZE_WRAP.remove(self.ledger)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._own_scope:
            self.scope.stop()
        self._advance()

    # -- results -----------------------------------------------------------------------------

    def report(self) -> MemoryReport:
        """The timeline, the peak and the per-module peaks so far."""
        self._advance()
        empty = MemorySample(
            t_s=0.0, by_category=dict.fromkeys(Category, 0), module="", phase=Phase.OTHER, step=0
        )
        allocator: dict[str, int] = {}
        if self.device == "cuda":
            from shardkit.tools.track import cuda_allocator

            allocator = cuda_allocator.figures()
        return MemoryReport(
            device=self.device,
            timeline=list(self.replay.timeline),
            peak=self.replay.peak or empty,
            module_peaks=self.replay.module_peak_list(),
            allocator=allocator,
        )

    # -- observation -------------------------------------------------------------------------

    def _where(self) -> Where:
        module, phase = self.scope.current()
        return self.scope.now(), module, phase, self.scope.step

    def _advance(self) -> None:
        self.replay.advance(self.ledger, self.scope.forward_ends)

    def _on_scope(self, change: ScopeChange) -> None:
        if change.what == "step":
            self._advance()
            self._grad_shapes.clear()

    def _learn_module(self, module: nn.Module) -> None:
        if id(module) in self._seen_modules:
            return
        for sub in module.modules():
            self._seen_modules.add(id(sub))
        for param in module.parameters():
            self.ledger.track_tensor(param, Category.SHARDED_PARAMS)
            if param.grad is not None:
                self.ledger.track_tensor(param.grad, Category.GRADIENTS)
        for buffer in module.buffers():
            self.ledger.track_tensor(buffer)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self._seen_modules:
            self._learn_module(module)  # an outermost module's first forward: still sharded
        self._note_unsharded(module)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._note_unsharded(module)

    def _note_unsharded(self, module: nn.Module) -> None:
        # The module's own parameters while it runs: not the sharded ones already known, so
        # FSDP's unsharded form (resident parameters of an unsharded model keep their higher
        # category). Seen before and after its forward, since global hooks run before an
        # FSDP module's own unshard hook and before its reshard hook.
        for param in module._parameters.values():
            if param is not None and has_own_storage(param):
                self.ledger.track(param.untyped_storage(), Category.UNSHARDED_PARAMS)

    def _learn_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.ledger.track_tensor(param, Category.SHARDED_PARAMS)
                if param.grad is not None:
                    self.ledger.track_tensor(param.grad, Category.GRADIENTS)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.ledger.track_tensor(value, Category.OPTIMIZER_STATE)

    def _on_op(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        is_comm: bool,
    ) -> None:
        ledger = self.ledger
        if is_comm:
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    ledger.track_tensor(value, Category.COMM_BUFFERS)
            return
        outputs = _tensors(out)
        if not outputs:
            return
        shapes = self._param_grad_shapes() if self.scope.in_backward else _NO_SHAPES
        for tensor in outputs:
            if not has_own_storage(tensor):
                continue
            hint = Category.GRADIENTS if shapes and tuple(tensor.shape) in shapes else None
            ledger.track(tensor.untyped_storage(), hint)

    def _param_grad_shapes(self) -> set[tuple[int, ...]] | frozenset[tuple[int, ...]]:
        """Shapes of the parameters whose gradient the running autograd node produces."""
        node = torch._C._current_autograd_node()
        if node is None:
            return _NO_SHAPES
        cached = self._grad_shapes.get(id(node))
        if cached is not None:
            return cached[1]
        shapes = set()
        for next_node, _ in node.next_functions:
            variable = getattr(next_node, "variable", None)  # AccumulateGrad: a leaf
            if isinstance(variable, torch.Tensor):
                shapes.add(tuple(variable.shape))
        self._grad_shapes[id(node)] = (node, shapes)
        return shapes


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors an operator returned (a tensor, or a flat tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        if all(isinstance(t, torch.Tensor) for t in out):
            return list(out)
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return []
