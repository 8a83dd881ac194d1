"""What every tracker shares: lifecycle, a light dispatch mode, process-wide method wraps.

The wraps are installed only while some tracker needs them.

See [Note: observing torch programs] in docs/notes/004-observing-torch-programs.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "COMM_NAMESPACES",
    "CollectiveListener",
    "CollectiveOps",
    "LightDispatchMode",
    "MethodWrap",
    "OpCall",
    "Tracker",
]

COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
"""Operator namespaces of collectives: c10d's and the functional ones (DTensor, compile)."""

T = TypeVar("T", bound="Tracker")


class Tracker:
    """start() / stop() plus their ``with`` form; subclasses implement the two."""

    def start(self: T) -> T:
        """Start tracking."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop tracking; what was recorded stays available."""
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LightDispatchMode(TorchDispatchMode):
    """A dispatch mode with as little per-operator cost as a Python mode can have."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling decorator unless told
        # otherwise; that wrapper alone costs about 3 us per operator. Nothing here is ever
        # compiled, so the wrapper buys nothing.
        return False

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._comm: dict[Any, bool] = {}  # OpOverload -> is it a collective

    def is_comm(self, func: Any) -> bool:
        """Whether ``func`` (an OpOverload) is a collective's operator (cached per operator)."""
        is_comm = self._comm.get(func)
        if is_comm is None:
            is_comm = self._comm[func] = func.namespace in COMM_NAMESPACES
        return is_comm

    def enter(self) -> None:
        """Push the mode on this thread's mode stack."""
        self.__enter__()  # type: ignore[no-untyped-call]

    def exit(self) -> None:
        """Pop it."""
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]


L = TypeVar("L")


class MethodWrap(Generic[L]):
    """Replaces ``owner.name`` by ``make(original, listeners)`` while listeners exist.

    Process-wide: the first listener installs the wrapper, the last one restores the
    original, so nested and concurrent trackers share one wrapper.
    """

    def __init__(
        self, owner: type, name: str, make: Callable[[Any, list[L]], Callable[..., Any]]
    ) -> None:
        self.owner, self.name, self._make = owner, name, make
        self.listeners: list[L] = []
        self._original: Any = None

    def add(self, listener: L) -> None:
        """Start telling ``listener`` (installing the wrapper if it is the first)."""
        if not self.listeners:
            self._original = getattr(self.owner, self.name)
            setattr(self.owner, self.name, self._make(self._original, self.listeners))
        self.listeners.append(listener)

    def remove(self, listener: L) -> None:
        """Stop telling ``listener`` (restoring the original if it was the last)."""
        self.listeners.remove(listener)
        if not self.listeners:
            setattr(self.owner, self.name, self._original)


_KEY = "BackendSelect"


class CollectiveListener(Protocol):
    """What :class:`CollectiveOps` tells: each collective operator call, after it returned."""

    def on_collective(self, call: OpCall) -> None:
        """``call`` ran (issued, for an asynchronous collective)."""


@dataclass(frozen=True, slots=True)
class OpCall:
    """One call of a collective operator, as the hook saw it."""

    func: Any  # the OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    called_s: float  # time.perf_counter() before the call
    returned_s: float  # and after


class CollectiveOps:
    """Python kernels for the collective operators, registered while listeners exist.

    The kernels sit at the ``BackendSelect`` key. Every dispatch goes through it (it is in
    every thread's included keys, and stays there under autograd's exclusions, inference
    mode, and inside DTensor's own dispatch, where redistributions run with every key above
    ``Python`` excluded), just above the backend kernel; every other operator has a
    fallthrough there (only factory functions have kernels, and collectives are none). So a
    kernel there sees every call of a collective operator (from Python or from C++, such as
    DDP's reducer, funcol or DTensor), and the other operators cost nothing: unlike a dispatch
    mode, nothing runs for them. It passes the call on to the backend, then tells the
    listeners. A collective called while another is running (c10d's operator carrying out a
    functional collective) is part of that one and is not told. The registrations are
    removed when the last listener leaves. See [Note: observing torch programs].
    """

    def __init__(self, ops: dict[str, tuple[str, ...]]) -> None:
        self._ops = ops  # namespace -> operator names
        self.listeners: list[CollectiveListener] = []
        self._libraries: list[torch.library.Library] = []
        self._running = threading.local()  # .depth: hooked calls running on this thread

    def add(self, listener: CollectiveListener) -> None:
        """Start telling ``listener`` (registering the kernels if it is the first)."""
        if not self.listeners:
            for namespace, names in self._ops.items():
                library = torch.library.Library(namespace, "IMPL")
                for name in names:
                    func = getattr(getattr(torch.ops, namespace), name).default
                    library.impl(name, self._kernel(func), _KEY, with_keyset=True)
                self._libraries.append(library)
        self.listeners.append(listener)

    def remove(self, listener: CollectiveListener) -> None:
        """Stop telling ``listener`` (removing the kernels if it was the last)."""
        self.listeners.remove(listener)
        if not self.listeners:
            for library in self._libraries:
                library._destroy()
            self._libraries = []

    def _kernel(self, func: Any) -> Callable[..., Any]:
        listeners, running = self.listeners, self._running
        below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            called = time.perf_counter()
            depth = getattr(running, "depth", 0)
            running.depth = depth + 1
            try:
                out = func.redispatch(keyset & below, *args, **kwargs)
            finally:
                running.depth = depth
            if depth == 0:
                call = OpCall(func, args, kwargs, out, called, time.perf_counter())
                for listener in tuple(listeners):
                    listener.on_collective(call)
            return out

        return kernel
