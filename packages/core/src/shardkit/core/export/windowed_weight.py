"""A checkpoint tensor of which only one engine rank's window is held: what its loader narrows.

vLLM's weight loaders take a checkpoint tensor whole and narrow it to their rank's rows or
columns (``loaded_weight.narrow(dim, rank * size, size)``), then copy. A
:class:`WindowedWeight` has the whole tensor's shape and dtype but holds only one window's
elements: a narrow into the window returns them (a plain tensor, no copy); a narrow that
reaches outside it, or any other operation on the whole, raises an error naming the tensor,
the window and what was asked. So the engine's own loaders place the slice (their fused
layout, their padding), and a window that is not what the loader takes fails loudly instead
of loading wrong rows.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.core.export.tp_slices import Window

__all__ = ["WindowedWeight", "windowed"]

_aten = torch.ops.aten


class WindowedWeight(torch.Tensor):
    """A tensor of ``shape`` of which only the block at ``origin`` (``held``) exists."""

    tensor_name: str
    held: torch.Tensor
    origin: tuple[int, ...]

    @staticmethod
    def __new__(
        cls, name: str, shape: tuple[int, ...], held: torch.Tensor, origin: tuple[int, ...]
    ) -> WindowedWeight:
        """A tensor of ``shape`` holding ``held`` at ``origin`` (its first index per dim)."""
        made: WindowedWeight = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=held.dtype, device=held.device, requires_grad=False
        )
        made.tensor_name, made.held, made.origin = name, held, origin
        return made

    def __init__(self, *args: Any) -> None:
        super().__init__()

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"WindowedWeight({self.tensor_name}, shape={list(self.shape)}, holds "
            f"{self._held_ranges()})"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        this = args[0]
        if func is _aten.slice.Tensor and isinstance(this, WindowedWeight):
            return this._narrowed(*args[1:], **kwargs)
        if func in (_aten.detach.default, _aten.alias.default) and isinstance(this, WindowedWeight):
            return WindowedWeight(this.tensor_name, tuple(this.shape), this.held, this.origin)
        name = this.tensor_name if isinstance(this, WindowedWeight) else "a windowed tensor"
        raise TypeError(
            f"{name}: this engine rank received only {_describe(this)} of it, and the "
            f"loader asked for {func} over more than that"
        )

    def _held_ranges(self) -> str:
        return " x ".join(
            f"[{o}, {o + n})" for o, n in zip(self.origin, self.held.shape, strict=True)
        )

    def _narrowed(
        self, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
    ) -> torch.Tensor:
        """The tensor's rows ``[start, end)`` along ``dim``: a window of the held block."""
        dim %= self.dim()
        size = self.shape[dim]
        first = 0 if start is None else (start + size if start < 0 else start)
        last = size if end is None else (end + size if end < 0 else end)
        first, last = max(0, min(first, size)), max(0, min(last, size))
        have = self.origin[dim]
        held_rows = self.held.shape[dim]
        shape = list(self.shape)
        shape[dim] = max(0, last - first)
        origin = list(self.origin)
        if step == 1 and have <= first and last <= have + held_rows:
            held = self.held.narrow(dim, first - have, max(0, last - first))
            origin[dim] = 0
        elif step == 1 and first <= have and have + held_rows <= last:
            held = self.held
            origin[dim] = have - first
        else:
            raise ValueError(
                f"{self.tensor_name}: the engine's loader takes [{first}, {last}) along dim {dim}, "
                f"but this engine rank received {self._held_ranges()}: the window is not the "
                "engine's (another TP degree, rank or head layout?)"
            )
        if all(o == 0 for o in origin) and tuple(held.shape) == tuple(shape):
            return held
        return WindowedWeight(self.tensor_name, tuple(shape), held, tuple(origin))


def _describe(tensor: Any) -> str:
    if isinstance(tensor, WindowedWeight):
        return tensor._held_ranges()
    return "a window"


def windowed(window: Window, elements: torch.Tensor) -> torch.Tensor:
    """What an engine's loader takes for one window.

    The elements themselves where the window is the whole tensor, else a
    :class:`WindowedWeight` of the full shape.
    """
    if window.dim is None:
        return elements
    origin = tuple(start for start, _ in window.box)
    return WindowedWeight(window.name, window.shape, elements, origin)
