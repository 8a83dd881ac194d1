"""torch's function and dispatch modes, each run by a plain function of the call.

The meta trace watches one step in several ways at once: the trace records what each torch
call uses and runs attention as a fused kernel, the cost counter counts attention calls and
ATen operators, a selective checkpoint counts the outputs it keeps, and backward's profile
follows every storage. Each watcher is a function of the call; these two modes are torch's
protocols (``TorchFunctionMode``, ``TorchDispatchMode``) around such a function, so that a
watcher keeps its state in an object of its own and the protocol is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FunctionCalls", "OperatorOutputs", "RunCall", "SeeOperator"]

RunCall = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""Runs ``func(*args, **kwargs)`` (or what stands in for it) and returns its result."""

SeeOperator = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]
"""Told of an ATen operator (an ``OpOverload``) once it ran: (func, args, kwargs, output)."""


class FunctionCalls(TorchFunctionMode):
    """Every torch function call goes through ``run``, which makes it (or stands in for it)."""

    def __init__(self, run: RunCall) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.run(func, args, kwargs or {})


class OperatorOutputs(TorchDispatchMode):
    """Every ATen operator runs as it is; then ``see`` is told of it, with its output."""

    def __init__(self, see: SeeOperator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's, unannotated
        self.see = see

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.see(func, args, kwargs, out)
        return out
