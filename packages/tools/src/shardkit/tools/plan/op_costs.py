"""What a step's operators cost: FLOPs, bytes moved and kernels, counted on the meta device.

While ``trace`` runs the model forward, the loss and backward on the meta device, a
:class:`CostCounter` sees every ATen operator (a ``TorchDispatchMode``) and records, per
operator, the FLOPs (torch's ``flop_registry`` formulas: matrix multiplies, convolutions,
attention kernels), the bytes it reads and writes (its tensor inputs and outputs) and the
dtype it computes in. Operators are grouped by the trace's segments (forward and backward of
each) and by module FQN (each module's forward, children included), so that a checkpointed
module's recomputation can be priced as its forward again in backward. The optimizer's step is
counted the same way, by running ``torch.optim`` on meta shards (:func:`optimizer_costs`).

Nothing here knows a machine: :mod:`shardkit.tools.plan.timing.step_time` turns the counts into
seconds with a :class:`~shardkit.tools.plan.timing.hardware.Hardware` profile.

What is not a kernel is left out: views, factory functions that only allocate (``empty``),
and profiler markers. Attention run by the trace as a fused kernel (``FusedAttention``) is
counted at ``scaled_dot_product_attention``'s call: 4·B·H·L·S·E FLOPs forward, half of it when
causal (a fused kernel skips the masked blocks), and 2.5 times the forward in backward (five
matrix multiplies to forward's two).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from shardkit.tools.plan.backward import attention_call
from shardkit.tools.plan.call_modes import FunctionCalls, OperatorOutputs, SeeOperator
from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.recompute import observing_recomputed_attention, recomputing

__all__ = [
    "CostCounter",
    "OpCost",
    "StepCosts",
    "attention_flops",
    "operator_bytes",
    "optimizer_costs",
]


@dataclass(frozen=True, slots=True)
class OpCost:
    """Operators of one size: what each computes and moves, and how many ran."""

    flops: int
    """Floating-point operations of one (a multiply-add is two)."""
    nbytes: int
    """Bytes one reads and writes: its tensor inputs and outputs."""
    dtype: str
    """The dtype it computes in (its first floating tensor's; '' if none), e.g. 'bfloat16'."""
    count: int = 1
    """How many such operators ran."""
    attention: bool = False
    """Whether it is attention (a fused kernel, whose FLOP rate is not a matrix multiply's)."""


Costs = tuple[OpCost, ...]
"""Operators grouped by (flops, bytes, dtype), in order of first appearance."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCosts:
    """The operators of one training step, by segment and by module."""

    forward: tuple[Costs, ...]
    """Per forward segment (as ``trace``'s segments; the loss counts in the last)."""
    backward: tuple[Costs, ...]
    """Per segment, what backward runs while in it."""
    modules: dict[str, Costs] = field(default_factory=dict)
    """Module FQN -> its forward (children included): what a checkpointed module reruns."""
    matmul_free: dict[str, Costs] = field(default_factory=dict)
    """Module FQN -> its forward without FLOP-counted operators: what selective
    checkpointing reruns (it saves the outputs of matrix multiplies and attention)."""
    recompute: tuple[Costs, ...] = ()
    """Per segment, the part of ``backward`` that reruns checkpointed modules' forwards
    (torch's own checkpoint runs in the meta backward, so this is what it really reruns)."""
    module_segment: dict[str, int] = field(default_factory=dict)
    """Module FQN -> the last forward segment its operators ran in: backward reruns it
    there (modules that ran no operator are left out)."""
    optimizer: Costs = ()
    """The optimizer's step on this rank's shards."""

    @property
    def kernels(self) -> int:
        """Operators launched by forward, backward (recomputation included) and the optimizer."""
        every = [*self.forward, *self.backward, self.optimizer]
        return sum(c.count for costs in every for c in costs)


# Operators that launch no kernel: they allocate, or mark the profiler's ranges.
_NO_KERNEL = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "lift_fresh"}
)
_NO_KERNEL_VIEWS = frozenset({"_unsafe_view", "detach", "alias"})


def _launches(func: Any) -> bool:
    """Whether an ATen operator runs a kernel (views alias and in-place ops do write)."""
    if func.namespace != "aten":
        return False  # profiler markers and the like
    name = func._overloadpacket.__name__  # the op's name, public in practice
    if name in _NO_KERNEL or name in _NO_KERNEL_VIEWS:
        return False
    returns = func._schema.returns
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def operator_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
    """Bytes an ATen operator reads and writes, as the step's counts have them.

    Its tensor inputs and outputs; None for one that launches no kernel (a view, an
    allocation).
    """
    if not _launches(func):
        return None
    return _nbytes(_tensors((args, kwargs))) + _nbytes(_tensors(out))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _dtype(tensors: list[torch.Tensor]) -> str:
    for t in tensors:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return ""


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Tally:
    """Operators counted by (flops, bytes, dtype, attention)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, int, str, bool]] = Counter()

    def add(self, flops: int, nbytes: int, dtype: str, attention: bool) -> None:
        self.counts[(flops, nbytes, dtype, attention)] += 1

    def costs(self, keep: Callable[[int], bool] = lambda flops: True) -> Costs:
        return tuple(
            OpCost(f, b, d, n, attention=a) for (f, b, d, a), n in self.counts.items() if keep(f)
        )


class CostCounter:
    """Counts the operators of a meta-device step by segment and module.

    Args:
        segment: The current forward segment (the trace's recorder's).
        backward_segment: The segment backward is in (the trace's cursor's).
    """

    def __init__(self, segment: Callable[[], int], backward_segment: Callable[[], int]) -> None:
        self._segment, self._backward_segment = segment, backward_segment
        self.in_backward = False
        self._forward: dict[int, _Tally] = {}
        self._backward: dict[int, _Tally] = {}
        self._recompute: dict[int, _Tally] = {}
        self._modules: dict[str, _Tally] = {}
        self._module_segment: dict[str, int] = {}
        self._stack: list[str] = []  # the modules whose forward runs now, outermost first

    def add(self, flops: int, nbytes: int, dtype: str, *, attention: bool = False) -> None:
        """One operator, in the current segment of forward or backward."""
        if self.in_backward:
            self.add_backward(self._backward_segment(), flops, nbytes, dtype, attention=attention)
            return
        segment = self._segment()
        self._forward.setdefault(segment, _Tally()).add(flops, nbytes, dtype, attention)
        for name in self._stack:
            self._modules.setdefault(name, _Tally()).add(flops, nbytes, dtype, attention)
            self._module_segment[name] = segment

    def add_backward(
        self, segment: int, flops: int, nbytes: int, dtype: str, *, attention: bool = False
    ) -> None:
        """One operator of backward in ``segment`` (known in forward, for a fused kernel's)."""
        self._backward.setdefault(segment, _Tally()).add(flops, nbytes, dtype, attention)
        if recomputing():
            self._recompute.setdefault(segment, _Tally()).add(flops, nbytes, dtype, attention)

    def forward_segment(self) -> int:
        """The forward segment running now."""
        return self._segment()

    @contextmanager
    def counting(self, model: nn.Module | None = None) -> Iterator[None]:
        """Count while held: ATen operators, attention calls, and ``model``'s modules."""
        with ExitStack() as stack:
            if model is not None:
                stack.enter_context(self._module_hooks(model))
            stack.enter_context(OperatorOutputs(_operator_counter(self)))
            attention = _Attention(self)
            stack.enter_context(FunctionCalls(attention.run))
            stack.enter_context(observing_recomputed_attention(attention.recomputed))
            yield

    @contextmanager
    def _module_hooks(self, model: nn.Module) -> Iterator[None]:
        handles = []
        for name, module in model.named_modules():

            def pre(module: nn.Module, args: Any, name: str = name) -> None:
                self._stack.append(name)

            def post(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                if self._stack and self._stack[-1] == name:
                    self._stack.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def costs(self, segments: int, optimizer: Costs = ()) -> StepCosts:
        """What was counted, for ``segments`` segments."""
        empty = _Tally()
        return StepCosts(
            forward=tuple(self._forward.get(j, empty).costs() for j in range(segments)),
            backward=tuple(self._backward.get(j, empty).costs() for j in range(segments)),
            recompute=tuple(self._recompute.get(j, empty).costs() for j in range(segments)),
            modules={name: t.costs() for name, t in self._modules.items()},
            matmul_free={name: t.costs(lambda f: f == 0) for name, t in self._modules.items()},
            module_segment=dict(self._module_segment),
            optimizer=optimizer,
        )


def _operator_counter(counter: CostCounter) -> SeeOperator:
    """Every ATen operator that launches a kernel: its FLOPs, bytes and dtype."""

    def see(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        moved = operator_bytes(func, args, kwargs, out)
        if moved is not None:
            formula = flop_registry.get(func._overloadpacket)
            flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
            counter.add(flops, moved, _dtype(_tensors((args, kwargs)) + _tensors(out)))

    return see


class _Attention:
    """``scaled_dot_product_attention`` as the fused kernel the trace stands in for.

    Its function mode is entered inside the trace's own, so it sees the call before the trace
    replaces it by ``FusedAttention`` (whose allocations are no kernels of their own).
    """

    def __init__(self, counter: CostCounter) -> None:
        self.counter = counter

    def run(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Count an attention call, then make it (every call is made as it is)."""
        call = attention_call(func, args, kwargs)
        if call is not None:
            self._count(call.query, call.key, call.value, causal=call.causal)
        return func(*args, **kwargs)

    def recomputed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        """Attention rerun by a checkpointed module in backward: its forward kernel again."""
        flops, moved, _ = _attention_cost(q, k, v, causal=causal)
        self.counter.add(flops, moved, _dtype([q]), attention=True)

    def _count(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> None:
        flops, moved, out = _attention_cost(q, k, v, causal=causal)
        dtype = _dtype([q])
        self.counter.add(flops, moved, dtype, attention=True)
        # Backward of the same segment: five products (QKᵀ again, dV, dP, dQ, dK), reading
        # q, k, v, out and its gradient and writing three gradients.
        segment = self.counter.forward_segment()
        self.counter.add_backward(segment, 5 * flops // 2, 2 * moved + out, dtype, attention=True)


def _attention_cost(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> tuple[int, int, int]:
    """Forward FLOPs, bytes moved and bytes written of a fused attention kernel."""
    flops = attention_flops(q.shape, k.shape, v.shape, causal=causal)
    batch, length, value_width = math.prod(q.shape[:-2]), q.shape[-2], v.shape[-1]
    out = batch * length * value_width * q.element_size()
    return flops, _nbytes([q, k, v]) + out, out


def attention_flops(
    query: Sequence[int], key: Sequence[int], value: Sequence[int], *, causal: bool
) -> int:
    """Forward FLOPs of attention: Q Kᵀ then P V, half of it when causal.

    Shapes: queries (..., L, E), keys (..., S, E), values (..., S, Ev). Causal attention
    counts half: a fused kernel skips the masked blocks.
    """
    batch, length, keys = math.prod(query[:-2]), query[-2], key[-2]
    flops = 2 * batch * length * keys * (query[-1] + value[-1])
    return flops // 2 if causal else flops


def optimizer_costs(groups: list[GroupSpec], options: PlanOptions, shard_rank: int) -> Costs:
    """The optimizer's step on this rank's shards, counted by running it on the meta device.

    One tensor per trainable parameter (its local shard), as the engine's optimizer sees
    them; per tensor on gloo (the CPU's default), ``foreach`` on NCCL (GPUs'). The first step
    makes the state; the second, a steady-state one, is counted.
    """
    shards = []
    for group in groups:
        for p in group.trainable:
            shard = nn.Parameter(
                torch.empty(p.local_numel(shard_rank), dtype=p.dtype, device="meta")
            )
            shard.grad = torch.empty_like(shard)
            shards.append(shard)
    if not shards:
        return ()
    foreach = options.backend == "nccl"
    optimizer: torch.optim.Optimizer
    if options.optimizer in ("adamw", "adam"):
        kind = torch.optim.AdamW if options.optimizer == "adamw" else torch.optim.Adam
        optimizer = kind(shards, foreach=foreach)
    else:
        # Muon's elementwise work is SGD's with momentum (its Newton-Schulz: the planner adds
        # muon_step.newton_schulz_costs)
        momentum = 0.9 if options.optimizer in ("sgd_momentum", "muon") else 0.0
        optimizer = torch.optim.SGD(shards, lr=0.1, momentum=momentum, foreach=foreach)
    optimizer.step()
    counter = CostCounter(lambda: 0, lambda: 0)
    with counter.counting():
        optimizer.step()
    return counter.costs(1).forward[0]
