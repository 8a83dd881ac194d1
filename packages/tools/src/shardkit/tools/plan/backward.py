"""Memory of backward, measured by running it on the meta device.

While a segment runs backward, autograd holds the activations saved in forward (releasing each
once the op that saved it has run backward), the gradients of activations (the gradient flowing
into a block, those of its intermediate results) and the scratch of backward kernels. How these
overlap depends on each op's backward formula, so rather than guess it the planner runs
backward on the meta device (free: meta tensors have sizes, no data) and follows every storage:
the saved ones until autograd drops them, and every one backward creates.

Parameter gradients are not counted here (the planner counts them itself, in the engine's
dtype and lifetime), but when each appears is: a segment's gradients come one by one as its
ops run backward, while its activations go. Per segment, the result is the moment of the
highest total (the saved activations, the backward scratch and the segment's parameter
gradients so far), which of its gradients exist then, and the saved activations left when the
segment is done.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.tools.plan.call_modes import OperatorOutputs

__all__ = [
    "AttentionCall",
    "BackwardSegment",
    "FusedAttention",
    "SegmentCursor",
    "attention_call",
    "backward_profile",
    "fused_attention",
    "in_fused_attention",
    "unit_loss",
]

logger = logging.getLogger(__name__)


class SegmentCursor:
    """Which segment backward is in.

    Gradient hooks on the tensors crossing each group event move it down as backward passes
    the event (backward walks the segments in reverse).
    """

    def __init__(self) -> None:
        self.segment = 0

    def hook(self, segment: int) -> Callable[[torch.Tensor], None]:
        """A tensor hook for a tensor crossing the event that ends segment ``segment``."""

        def entering(grad: torch.Tensor) -> None:
            # min: a tensor used by several groups gets its full gradient late; never go back.
            self.segment = min(self.segment, segment)

        return entering


@dataclass(frozen=True, slots=True)
class BackwardSegment:
    """Live bytes while backward runs one segment."""

    activations: int
    """Saved activations (all segments) at the segment's peak."""
    scratch: int
    """Activation gradients, kernel scratch and what the loss saved, at that moment."""
    activations_after: int
    """Saved activations still held once the segment's backward is done."""
    scratch_after: int
    """Backward's own bytes still held then (the gradient flowing on to the next segment)."""
    grads_at_peak: frozenset[str] = frozenset()
    """The parameters (FQNs) whose gradients this segment made before its peak; the rest of
    its gradients come after it."""


class FusedAttention(torch.autograd.Function):
    """Attention as a fused (flash) kernel does it, on sizes only.

    Forward saves q, k, v, the output and a float32 log-sum-exp per query row; backward makes
    the gradients of q, k and v. The meta device's math fallback would instead save and
    differentiate the (B, H, T, T) scores, which GPUs never materialise.
    """

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Output (..., L, Ev) for query (..., L, E) and value (..., S, Ev)."""
        if query.dim() == 4:
            # Fused kernels (flash on GPUs and CPUs) write (B, L, H, Ev) and return it as
            # (B, H, L, Ev): transposing back for the output projection then copies nothing.
            b, h, length, _ = query.shape
            out = query.new_empty((b, length, h, value.shape[-1])).transpose(1, 2)
        else:
            out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients shaped like query, key and value."""
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_FUSED = [0]  # FusedAttention forwards running now (what they allocate is attention's)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """:class:`FusedAttention` on ``query``, ``key``, ``value``, marked as attention's.

    While it runs, :func:`in_fused_attention` is true: a selective checkpoint keeps what it
    makes (its output and log-sum-exp), as it keeps a fused kernel's outputs.
    """
    _FUSED[0] += 1
    try:
        out: torch.Tensor = FusedAttention.apply(query, key, value)  # type: ignore[no-untyped-call]
    finally:
        _FUSED[0] -= 1
    return out


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """The tensors and causality of one ``scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    causal: bool


_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def attention_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> AttentionCall | None:
    """``func(*args, **kwargs)`` read as attention, or None when it is something else.

    Each argument may come by position or by name, as the function's signature allows; the
    planner's stand-ins (forward, recomputation) and its operator count read it alike.
    """
    if func is not F.scaled_dot_product_attention:
        return None
    given = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
    q, k, v = (given.get(name) for name in _ATTENTION_ARGS[:3])
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    return AttentionCall(q, k, v, bool(given.get("is_causal", False)))


def in_fused_attention() -> bool:
    """Whether a :func:`fused_attention` forward is running."""
    return _FUSED[0] > 0


class _UnitLoss(torch.autograd.Function):
    """A scalar loss whose gradient is a dense tensor per output, as a real loss's is.

    The gradient is made in backward and dropped once used, so it costs memory only while
    the last layers run backward (seeding ``backward`` with it would keep it all along).
    """

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:
        """Zero, on the outputs' device; remembers their shapes."""
        ctx.metas = [(t.shape, t.dtype, t.device) for t in outputs]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Ones shaped like each output."""
        return tuple(torch.ones(s, dtype=d, device=v) for s, d, v in ctx.metas)


_SAVED, _SCRATCH = 0, 1


class _Follow:
    """Logs allocations and frees of storages while backward runs, with the segment."""

    def __init__(self, cursor: SegmentCursor) -> None:
        self.cursor = cursor
        self.keys = WeakIdKeyDictionary()  # live storage -> its key
        self.log: list[tuple[int, int]] = []  # (key, segment): alloc when first seen, else free
        self.kind: list[int] = []  # per key: _SAVED or _SCRATCH
        self.nbytes: list[int] = []

    def see(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """An operator backward ran: each storage it made is scratch until freed."""
        schema = getattr(func, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            return  # a view or in-place op: its storage was made earlier (maybe in forward)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.follow(leaf.untyped_storage(), _SCRATCH)

    def follow(self, storage: torch.UntypedStorage, kind: int) -> None:
        if storage in self.keys:
            return
        key = len(self.kind)
        self.keys[storage] = key
        self.kind.append(kind)
        self.nbytes.append(storage.nbytes())
        self.log.append((key, self.cursor.segment))
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.log.append((key, self.cursor.segment))

    def key_of(self, tensor: torch.Tensor) -> int | None:
        key: int | None = self.keys.get(tensor.untyped_storage())
        return key


def unit_loss(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A scalar whose backward feeds a dense ones gradient to each output."""
    loss: torch.Tensor = _UnitLoss.apply(*outputs)  # type: ignore[no-untyped-call]  # torch's
    return loss


def backward_profile(
    loss: torch.Tensor,
    cursor: SegmentCursor,
    saved: WeakIdKeyDictionary,
    leaves: dict[str, torch.Tensor],
    segments: int,
) -> tuple[BackwardSegment, ...] | None:
    """Run backward from ``loss`` and profile each segment's memory.

    Args:
        loss: What to backpropagate (see :func:`unit_loss`); the caller holds no outputs.
        cursor: Moved by the hooks forward put on the tensors crossing group events.
        saved: The storages forward saved for backward, held weakly (autograd must be able to
            free them), each mapped to (segment, saved by the loss); the loss's count as
            scratch, not activations.
        leaves: The parameters by FQN, whose gradients are not counted but placed.
        segments: How many segments the forward had.

    Returns:
        One profile per segment, or None when backward cannot run on the meta device.
    """
    cursor.segment = segments - 1
    mode = _Follow(cursor)
    _follow_saved(mode, saved)
    try:
        with OperatorOutputs(mode.see):
            loss.backward()
    except Exception as err:  # a missing meta kernel, say: plan without this profile
        logger.warning("backward on the meta device failed (%s): not counting its memory", err)
        return None
    grads: dict[int, str] = {}
    for name, leaf in leaves.items():
        key = mode.key_of(leaf.grad) if leaf.grad is not None else None
        if key is not None:
            grads[key] = name
    return _replay(mode, grads, segments)


@dataclass(slots=True)
class _Peak:
    total: int
    saved: int
    scratch: int
    grads: frozenset[str]


def _replay(mode: _Follow, grads: dict[int, str], segments: int) -> tuple[BackwardSegment, ...]:
    """Walk the log: per segment, the live bytes at its highest total, and when it ends.

    ``grads``: the storage keys of the parameters' gradients, and whose. Each counts in the
    segment it appears in (the engine's lifetime of it is the planner's to model).
    """
    live = [0, 0]  # (saved, scratch)
    alive: set[int] = set()
    peaks: dict[int, _Peak] = {}
    after: dict[int, tuple[int, int]] = {}
    made: dict[int, set[str]] = {}  # segment -> the parameters whose gradients it made so far
    made_bytes: dict[int, int] = {}  # segment -> their bytes
    for key, segment in mode.log:
        name = grads.get(key)
        if key in alive:
            if name is None:  # a gradient is never freed here: its parameter holds it
                alive.discard(key)
                live[mode.kind[key]] -= mode.nbytes[key]
        else:
            alive.add(key)
            if name is None:
                live[mode.kind[key]] += mode.nbytes[key]
            else:
                made.setdefault(segment, set()).add(name)
                made_bytes[segment] = made_bytes.get(segment, 0) + mode.nbytes[key]
            total = sum(live) + made_bytes.get(segment, 0)
            if total > (peaks[segment].total if segment in peaks else -1):
                names = frozenset(made.get(segment, ()))
                peaks[segment] = _Peak(total, live[_SAVED], live[_SCRATCH], names)
        after[segment] = (live[_SAVED], live[_SCRATCH])
    result: list[BackwardSegment] = []
    level = (0, 0)
    for j in range(segments - 1, -1, -1):  # backward order
        end = after.get(j, level)
        # A segment where nothing was allocated keeps the level it was entered with.
        peak = peaks.get(j, _Peak(0, level[0], level[1], frozenset()))
        result.append(BackwardSegment(peak.saved, peak.scratch, *end, peak.grads))
        level = end
    return tuple(reversed(result))


def _follow_saved(mode: _Follow, saved: WeakIdKeyDictionary) -> None:
    # A function of its own so that no local variable keeps a storage alive afterwards.
    for storage, (_, in_loss) in list(saved.items()):
        mode.follow(storage, _SCRATCH if in_loss else _SAVED)
