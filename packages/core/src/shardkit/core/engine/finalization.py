"""Manual backward finalization (torch 2.15's API), on every torch release.

``set_manual_backward_finalization(True)`` on the root: each backward's end-of-backward
callback runs the driver's ``final_callback`` without finishing reductions, and
``finalize_backward`` ends the backward iteration: groups holding gradients nobody reduced end
their backward, every reduction is finished (or, asynchronously, by the handle's ``wait``), every
group is resharded as set. The root's mode is captured when a backward starts (``FSDPState``'s
callback) and cannot change until the iteration is finalized, as in torch. Torch 2.15's
pipeline stages drive shardkit's stages through these. See [Note: torch-facing view].
"""

from __future__ import annotations

from shardkit.core.engine.root_context import RootState
from shardkit.core.engine.usage_checks import in_backward

__all__ = ["finalize_backward", "set_manual_finalization", "wait_for_gradient_reduction"]


def set_manual_finalization(state: RootState, enabled: bool) -> None:
    """``FSDPModule.set_manual_backward_finalization``, checked as torch's.

    Raises:
        RuntimeError: ``state`` is not a root, or the mode would change during a backward or
            before the backward iteration started under the other mode is finalized.
    """
    if state.is_root is False:
        raise RuntimeError(
            "set_manual_backward_finalization must be called on the root FSDP module, "
            f"not on {state.fqn} (shardkit)"
        )
    active = None if state.ctx is None else state.ctx.manual_finalization
    if enabled != state.manual_finalization and in_backward():
        raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
    if active is not None and enabled != active:
        raise RuntimeError(
            "set_manual_backward_finalization cannot change mode after backward starts "
            "(finalize_backward first)"
        )
    state.manual_finalization = enabled


def finalize_backward(state: RootState, *, wait: bool = True) -> None:
    """``FSDPModule.finalize_backward``: end the backward iteration of ``state``'s root.

    With ``wait``, every reduction is finished too, else :func:`wait_for_gradient_reduction`
    finishes them. A no-op before the first forward.

    Raises:
        RuntimeError: not the root, manual finalization is off, a backward is running, or the
            reductions an earlier call started are not finished.
    """
    ctx = state.ctx
    if ctx is None:
        return
    if ctx.reduction_pending:
        raise RuntimeError(
            "The previous gradient reduction must be waited on before finalizing backward "
            "again (its handle's wait())"
        )
    if not state.is_root:
        raise RuntimeError(
            f"finalize_backward must be called on the root FSDP module, not {state.fqn}"
        )
    manual = ctx.manual_finalization
    if not (state.manual_finalization if manual is None else manual):
        raise RuntimeError(
            "FSDP finalize_backward requires manual backward finalization. Call "
            "set_manual_backward_finalization(True) before forward"
        )
    if ctx.final_callback_queued:
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    ctx.reduction_pending = True
    if wait:
        wait_for_gradient_reduction(state)
    else:
        # The driver's end of a backward that does not finalize: the reductions it starts stay
        # in flight, beside whatever the caller runs, until the handle's wait().
        state.end_backward(last=False)


def wait_for_gradient_reduction(state: RootState) -> None:
    """Finish what :func:`finalize_backward` started: the backward iteration ends."""
    ctx = state.ctx
    if ctx is None or not ctx.reduction_pending:
        return
    ctx.reduction_pending = False
    state.end_backward(last=True)
    ctx.manual_finalization = None
