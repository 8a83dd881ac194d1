"""Counting the operators a piece of code dispatches: what makes a GPU step launch-bound.

On a GPU, every operator that is not a view launches at least one kernel, and a step whose
kernels are small spends its time launching them: its CPU time, not its GPU time, sets the
pace. The count shows that on any machine, a laptop CPU included, without timing anything:
counts are exact and repeatable where times are noisy. Run a step under torch's fake process
group (one process standing for W ranks) at two world sizes, and an engine whose count grows
with W shows it at once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.tools.track.tracking import Tracker

__all__ = ["OpCounter"]

# Operators that are not views and yet launch no kernel on any device: allocation, storage
# bookkeeping, profiler markers. How many of them a step runs also depends on what a caching
# allocator or buffer pool happens to find free, so they are kept out of ``launches``.
_NO_KERNEL = frozenset(
    {
        "aten.empty",
        "aten.empty_strided",
        "aten.empty_like",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.lift_fresh",
        "aten.set_",
        "aten.resize_",
        "profiler._record_function_enter_new",
        "profiler._record_function_exit",
    }
)


class _Counting(TorchDispatchMode):
    """Counts every operator that reaches dispatch, by name, then runs it."""

    def __init__(self, counts: Counter[str], others: Counter[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's own, untyped
        self._counts = counts
        self._others = others  # views, and what launches no kernel

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = str(func.overloadpacket)
        self._counts[name] += 1
        if func.is_view or name in _NO_KERNEL:
            self._others[name] += 1
        return func(*args, **(kwargs or {}))


class OpCounter(Tracker):
    """A context manager that counts the operators dispatched inside it, by name.

    Example::

        with OpCounter() as ops:
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
        logger.info("%d ops, %d launches; most: %s", ops.total, ops.launches, ops.top(5))

    Counts add up over every ``with`` block of one counter. Operators that a custom operator
    runs inside its own kernel are not seen (one count for the custom operator), as on a GPU
    they would not be separate launches either.
    """

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        """Operators dispatched, by name (``aten.mm``, ``c10d._allgather_base_``)."""
        self.no_kernel: Counter[str] = Counter()
        """Those of them that launch no kernel on any device: views, allocations, storage
        bookkeeping and profiler markers."""
        self._mode: _Counting | None = None

    def start(self) -> OpCounter:
        """Start counting (what ``with`` does)."""
        self._mode = _Counting(self.by_op, self.no_kernel)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch: untyped
        return self

    def stop(self) -> None:
        """Stop counting; the counts stay."""
        assert self._mode is not None, "OpCounter stopped without starting"
        self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self._mode = None

    @property
    def total(self) -> int:
        """Every operator dispatched."""
        return sum(self.by_op.values())

    @property
    def launches(self) -> int:
        """Operators that launch a kernel on a GPU (at least one), collectives included."""
        return self.total - sum(self.no_kernel.values())

    def top(self, count: int = 10) -> list[tuple[str, int]]:
        """The ``count`` most frequent operators, with their counts."""
        return self.by_op.most_common(count)
