"""LivePeak: the peak of live tensor bytes in a stretch of code, with real or fake tensors.

The planner predicts one rank's live tensor bytes (``Plan.memory.peak.total``). To check a
prediction for a model too large to run on this machine, the step runs on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``): they have shapes, dtypes and storages
with sizes, but no data. :class:`~shardkit.tools.MemoryTracker` counts real storages only (it
sorts memory into categories by what it sees done to data), so this counter keeps to the
one figure both kinds of tensor give: bytes of every storage alive, its highest point.

How it counts: a dispatch mode sees every operator's outputs; each new storage adds its bytes
and a weak reference subtracts them when it is freed. ``UntypedStorage.resize_`` is wrapped
while counting, since FSDP engines grow and free unsharded parameters by resizing storages,
which no operator reports. Storages alive at the start are counted when they are found through
the modules (parameters, buffers, gradients) and optimizers (their state) given.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardkit.tools.track.tracking import Tracker

__all__ = ["LivePeak"]


def _holds_storage(tensor: torch.Tensor) -> bool:
    """A plain tensor, or a fake one: not a wrapper whose storage stands in (DTensor)."""
    kind = type(tensor)
    return kind is torch.Tensor or kind is nn.Parameter or hasattr(tensor, "fake_mode")


class _Counting(TorchDispatchMode):
    def __init__(self, peak: LivePeak) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's own, untyped
        self._peak = peak

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out) if not isinstance(out, torch.Tensor) else (out,):
            if isinstance(value, torch.Tensor):
                self._peak.see(value)
        return out


class LivePeak(Tracker):
    """Counts live tensor bytes inside a ``with`` block; ``peak`` is their highest point.

    Example::

        with LivePeak(model, optimizers=[opt]) as live:
            train_step()
        logger.info("peak %d bytes", live.peak)

    Args:
        modules: whose parameters (their local shards), gradients and buffers are alive at the
            start.
        optimizers: whose state is alive at the start.
    """

    def __init__(
        self, *modules: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
    ) -> None:
        self._modules = modules
        self._optimizers = tuple(optimizers)
        self.live = 0
        """Bytes alive now (of the storages seen)."""
        self.peak = 0
        """The highest ``live`` so far."""
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[Any, int] = {}  # weak reference -> id(storage)
        self._mode: _Counting | None = None
        self._resize: Any = None

    def start(self) -> LivePeak:
        """Start counting (what ``with`` does): the storages alive now, then every new one."""
        for tensor in self._alive_at_start():
            self.see(tensor)
        original = torch.UntypedStorage.resize_
        self._resize = original

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self._mode = _Counting(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch: untyped
        return self

    def stop(self) -> None:
        """Stop counting; ``peak`` stays."""
        assert self._mode is not None, "LivePeak stopped without starting"
        self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self._mode = None
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def see(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage if it is new (a DTensor: its local shard)."""
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if not _holds_storage(tensor):
            return
        self._track(tensor.untyped_storage())

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        # torch keeps one Python object per storage for the storage's whole life, so its id
        # names it until the weak reference's callback removes it.
        self._refs[weakref.ref(storage, self._freed)] = key
        self._sizes[key] = 0
        self._resized(storage)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._track(storage)  # made before counting began (an unsharded parameter's)
            return
        nbytes = storage.nbytes()
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _freed(self, ref: Any) -> None:
        key = self._refs.pop(ref, None)
        if key is not None:
            self.live -= self._sizes.pop(key, 0)

    def _alive_at_start(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for module in self._modules:
            for param in module.parameters():
                found.append(param)
                if param.grad is not None:
                    found.append(param.grad)
            found.extend(module.buffers())
        for optimizer in self._optimizers:
            for state in optimizer.state.values():
                found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return found
