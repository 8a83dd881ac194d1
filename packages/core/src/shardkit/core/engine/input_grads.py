"""When backward is done with a group that has frozen parameters: its inputs' gradients are made.

A group whose parameters are all frozen still unshards in backward when gradients flow
through it (to its inputs), but no gradient hook tells it when that is over, so without this
it would stay gathered until the end-of-backward callback: a full copy of its parameters
held through the rest of backward. A group with frozen and trainable parameters (QLoRA's
frozen base weights and trainable adapters) may get its last gradient before autograd is
done with the frozen ones (the input gradient through a frozen weight is a node of its own):
it waits for this too. See [Note: post-backward trigger].

Its forward inputs that need gradients pass through an identity autograd function; the
function's backward runs once autograd has computed the gradients of those inputs inside the
group, that is, right after the group's own backward. Gradients pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["InputGradsWatch", "after_input_grads"]


class _AfterInputGrads(torch.autograd.Function):
    """Identity on its tensors; its backward calls ``done`` and passes gradients through."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.done()
        return (None, *grads)


class InputGradsWatch:
    """Counts a group's forward calls that backward has yet to go through.

    ``done`` runs when the last of them is through: a module called twice in one forward is
    needed by both backwards, so the group may reshard only after the second.
    """

    def __init__(self, done: Callable[[], None]) -> None:
        self._done = done
        self._pending = 0

    def wrap(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``args`` and ``kwargs`` with the tensors that need gradients passed through."""
        wrapped = after_input_grads(args, kwargs, self._one_done)
        if wrapped is not None:
            self._pending += 1
            return wrapped
        return args, kwargs  # backward never reaches this call

    def pending(self) -> bool:
        """Whether a forward call's backward through this group has yet to finish."""
        return self._pending > 0

    def _one_done(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._done()

    def reset(self) -> None:
        """Forget calls whose backward never ran (the end-of-backward callback covered them)."""
        self._pending = 0


def after_input_grads(
    args: tuple[Any, ...], kwargs: dict[str, Any], done: Callable[[], None]
) -> tuple[Any, Any] | None:
    """``args`` and ``kwargs`` passed through a function whose backward calls ``done``.

    None where no tensor among them needs a gradient (backward never reaches the call).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    needing = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not needing:
        return None
    tensors = (leaves[i] for i in needing)
    through = _AfterInputGrads.apply(done, *tensors)  # type: ignore[no-untyped-call]
    for i, tensor in zip(needing, through, strict=True):
        leaves[i] = tensor
    wrapped: tuple[Any, Any] = pytree.tree_unflatten(leaves, spec)
    return wrapped
