"""See the collectives a program issues outside the runtime, before they go out.

Under torch's ``Join``, a rank out of batches shadows what the others issue; a collective it
does not know of would pair with another of its own and abort gloo (or hang NCCL). The active
ranks therefore run, while some rank has joined, under a :class:`CollectiveWatch`: a torch
dispatch mode that sees each c10d operator (``dist.all_reduce`` and the others) and each of
DTensor's functional collectives before it is issued, and every operator on a DTensor before
DTensor runs it (the mode lets DTensor decompose it, as torch's ``CommDebugMode`` does, so the
collectives it issues come back through the mode). Collectives the runtime issues itself, and
torch's ``Join`` notification, pass untouched: a frame of either is on the stack.

A :class:`WatchPolicy` decides: issue the collective, or hold it back. Held back, the caller
gets a result that looks issued (its tensors unchanged, a completed work), so the program runs
on to a point where every rank can be told (``engine/join``).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = ["CollectiveWatch", "WatchPolicy", "collective_name", "drop_orphaned_watch"]

# A frame of these modules on the stack: the runtime's own collectives, or torch's notification.
_OWN_PREFIXES = ("shardkit.core.runtime.", "torch.distributed.algorithms.join")
_NAMESPACES = frozenset(("c10d", "_c10d_functional"))
# Operators of those namespaces that issue nothing: a functional collective's wait and wrapper.
_NOT_ISSUING = ("wait", "wrap")


class WatchPolicy(Protocol):
    """What a :class:`CollectiveWatch` asks about what it sees."""

    def on_dtensor_op(self, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> None:
        """An operator on DTensors, before DTensor runs it (it may then issue collectives)."""

    def issues(self, func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
        """Whether the collective ``func`` goes out (else it is held back and faked)."""

    def alive(self) -> bool:
        """Whether what the policy serves still exists; else the watch lets everything pass."""


class CollectiveWatch(TorchDispatchMode):
    """A dispatch mode that puts each collective issued outside the runtime to a policy.

    Entered and left across hooks (:meth:`start`, :meth:`stop`), not as a ``with`` block: it
    spans a stretch of the user's loop.
    """

    def __init__(self, policy: WatchPolicy) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.policy = policy
        self.started = False

    def start(self) -> None:
        """Push the mode (no-op if pushed)."""
        if not self.started:
            self.__enter__()  # type: ignore[no-untyped-call]
            self.started = True

    def stop(self) -> None:
        """Pop the mode, which must be the innermost one (no-op if not pushed)."""
        if not self.started:
            return
        if _get_current_dispatch_mode() is not self:
            raise RuntimeError(
                "Join: a torch dispatch mode entered during a Join iteration is still active at "
                "its end; leave it inside the iteration"
            )
        self.started = False
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not self.policy.alive():
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            self.policy.on_dtensor_op(func, args)
            return NotImplemented  # DTensor runs it; its collectives come back through here
        held = _issues_collective(func) and not _from_own_code()
        if held and not self.policy.issues(func, args):
            return _looks_issued(func, args)
        return func(*args, **kwargs)


def drop_orphaned_watch() -> None:
    """Pop a watch left innermost by an exception that ended what it served (a Join)."""
    mode = _get_current_dispatch_mode()
    if isinstance(mode, CollectiveWatch) and mode.started and not mode.policy.alive():
        mode.stop()


def collective_name(func: torch._ops.OpOverload) -> str:
    """How an error names a collective: ``c10d.allreduce_`` for ``dist.all_reduce``."""
    return f"{func.namespace}.{func._opname}"


def _issues_collective(func: torch._ops.OpOverload) -> bool:
    return func.namespace in _NAMESPACES and not any(w in func._opname for w in _NOT_ISSUING)


def _from_own_code() -> bool:
    """Whether the runtime (or torch's Join) issues it: one of their frames is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(_OWN_PREFIXES) and name != __name__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _looks_issued(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> Any:
    """What ``func`` returns had it run, with nothing sent: its tensors as they were."""
    if func.namespace == "_c10d_functional":
        if "all_reduce" in func._opname:
            first = args[0]
            return [t.clone() for t in first] if isinstance(first, list) else first.clone()
        raise RuntimeError(
            f"Join: {collective_name(func)} outside the engine while a rank is out of batches"
        )
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(args[0])
    c10d: Any = torch._C._distributed_c10d  # a completed work the dispatcher accepts
    work = c10d._create_work_from_future(future).boxed()
    returns = func._schema.returns
    return work if len(returns) == 1 else (args[0], work)
