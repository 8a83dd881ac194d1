"""Activation checkpointing in the meta trace: what checkpointed modules keep and recompute.

``PlanOptions.checkpoint`` names modules a script wraps with torch's non-reentrant
``checkpoint_wrapper`` before ``fully_shard``. Rather than guess what such a module keeps,
the trace runs its forward through torch's own ``torch.utils.checkpoint.checkpoint`` (what
the wrapper calls), on the meta device, so what is kept and what is recomputed is torch's:

- The checkpoint's own saved-tensor hooks sit inside the trace's: tensors saved in the module
  never reach the trace's hook; the checkpoint keeps the module's inputs (its recomputation
  needs them), which are counted here as saved in the segment where the module is called.
- ``selective`` (``create_selective_checkpoint_contexts``) also keeps the outputs of matrix
  multiplies and attention (the ops of :data:`SAVED_OPS`), counted as they are made.
- In backward, the module's forward runs again (its saved tensors are backward's scratch,
  as the trackers see them: made in backward), attention again as a fused kernel.

The module's own hooks (the group's, when it is a unit) stay outside the checkpoint, as a
wrapper's ``fully_shard`` hooks are. A checkpointed module that contains a unit would rerun
that unit's hooks in backward: not modelled (refused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from shardkit.tools.plan.backward import attention_call, fused_attention, in_fused_attention
from shardkit.tools.plan.call_modes import FunctionCalls, OperatorOutputs
from shardkit.tools.plan.groups import GroupSpec, named_module
from shardkit.tools.plan.options import PlanOptions

__all__ = [
    "SAVED_OPS",
    "check_checkpoint",
    "checkpointed_forwards",
    "observing_recomputed_attention",
    "recomputing",
    "saved_op_policy",
    "selective_context",
]

_aten = torch.ops.aten
SAVED_OPS: frozenset[Any] = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
"""What ``selective`` keeps: the outputs of matrix multiplies (``nn.Linear`` runs ``addmm`` or
``mm``) and of attention's kernels."""

Save = Callable[[torch.Tensor], None]
"""Counts a tensor's storage as saved for backward, in the current segment."""


def _has_selective() -> bool:
    return hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")


def saved_op_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``selective`` policy: keep :data:`SAVED_OPS`' outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in SAVED_OPS or in_fused_attention():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """``context_fn`` of a ``selective`` checkpoint: torch's selective contexts, our policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(saved_op_policy)


def check_checkpoint(model: nn.Module, options: PlanOptions, groups: list[GroupSpec]) -> None:
    """Refuse what cannot be checkpointed as named, or not modelled.

    Raises:
        ValueError: an FQN the model has no module for (near names listed).
        NotImplementedError: ``selective`` on a torch without selective checkpointing; a
            checkpointed module containing a unit's module.
    """
    named = dict(model.named_modules())
    units = {id(m): g.fqn for g in groups for m in g.call_modules}
    for fqn, mode in options.checkpoint:
        module = named_module(named, fqn, "checkpoint")
        if mode == "selective" and not _has_selective():
            raise NotImplementedError(
                "shardkit.tools.plan: 'selective' checkpointing needs torch's "
                "create_selective_checkpoint_contexts, which this torch lacks"
            )
        inner = [units[id(m)] for m in module.modules() if m is not module and id(m) in units]
        if inner:
            raise NotImplementedError(
                f"shardkit.tools.plan: checkpointed module {fqn} contains the unit {inner[0]}, "
                "whose hooks would run again in backward's recomputation; that is not "
                "modelled: checkpoint the modules inside the unit, or the unit itself"
            )


@contextmanager
def checkpointed_forwards(model: nn.Module, options: PlanOptions, save: Save) -> Iterator[None]:
    """The checkpointed modules' forwards run through torch's checkpoint while held.

    Calls after the context ends are backward's recomputations, which run attention as a
    fused kernel too (the forward's function mode is gone by then).
    """
    named = dict(model.named_modules())
    forward_done = [False]
    patched: list[nn.Module] = []
    try:
        for fqn, mode in options.checkpoint:
            module = named[fqn]
            run = _runner(module.forward, forward_done, save, selective=mode == "selective")
            context_fn = selective_context if mode == "selective" else None
            # On the instance, so the module's own hooks (its group's) stay outside.
            setattr(  # noqa: B010  (a method replaced on one instance)
                module,
                "forward",
                functools.partial(_checkpointed, run, context_fn, save),
            )
            patched.append(module)
        yield
    finally:
        forward_done[0] = True
        for module in patched:
            delattr(module, "forward")  # the class's forward again


def _checkpointed(
    run: Callable[..., Any],
    context_fn: Callable[[], Any] | None,
    save: Save,
    *args: Any,
    **kwargs: Any,
) -> Any:
    # The checkpoint keeps the inputs for its recomputation (its saved-tensor hooks, inside
    # the trace's, keep nothing else of full mode). The CPU generator state it keeps
    # (preserve_rng_state) is host memory the trackers do not see: not counted, and not
    # taken here (a meta tensor has no generator).
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            save(leaf)
    if context_fn is None:
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn, **kwargs
    )


AttentionObserver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]
"""Told of each attention a recomputation runs: (query, key, value, is_causal)."""

_ATTENTION_OBSERVERS: list[AttentionObserver] = []


@contextmanager
def observing_recomputed_attention(observe: AttentionObserver) -> Iterator[None]:
    """Call ``observe`` for each attention a recomputation runs while held.

    The recomputation runs attention as the fused kernel by a function mode of its own,
    entered after (inside) any other: an operator counter's mode never sees that call.
    """
    _ATTENTION_OBSERVERS.append(observe)
    try:
        yield
    finally:
        _ATTENTION_OBSERVERS.remove(observe)


_RECOMPUTING = [0]
"""How many checkpointed forwards are being rerun in backward now (they may nest)."""


def recomputing() -> bool:
    """Whether backward is rerunning a checkpointed module's forward now.

    The step-time model reports those operators as recomputation (they are backward's, and
    counted there).
    """
    return _RECOMPUTING[0] > 0


@contextmanager
def _recomputing() -> Iterator[None]:
    _RECOMPUTING[0] += 1
    try:
        yield
    finally:
        _RECOMPUTING[0] -= 1


def _runner(
    forward: Callable[..., Any], forward_done: list[bool], save: Save, *, selective: bool
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not forward_done[0]:
            if not selective:
                return forward(*args, **kwargs)
            with OperatorOutputs(functools.partial(_kept_outputs, save)):
                return forward(*args, **kwargs)
        # Selective recomputation reuses attention's saved output: no kernel runs again.
        fused = functools.partial(_fused_attention_only, reruns_kernel=not selective)
        with FunctionCalls(fused), _recomputing():
            return forward(*args, **kwargs)

    return run


def _kept_outputs(save: Save, func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """Counts the outputs the selective policy keeps, as the forward makes them."""
    if func in SAVED_OPS or in_fused_attention():
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                save(leaf)


def _fused_attention_only(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    reruns_kernel: bool,
) -> Any:
    """Attention as the fused kernel, in backward's recomputation as in the traced forward."""
    call = attention_call(func, args, kwargs)
    if call is not None:
        for observe in _ATTENTION_OBSERVERS if reruns_kernel else ():
            observe(call.query, call.key, call.value, call.causal)
        return fused_attention(call.query, call.key, call.value)
    return func(*args, **kwargs)
