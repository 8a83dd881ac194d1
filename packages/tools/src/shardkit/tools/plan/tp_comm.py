"""The tensor-parallel collectives of a training step, from a forward on the meta device.

DTensor communicates where a style converts a tensor between placements on the tp axis:
forward, where a style redistributes its module's input or output; backward, where the
gradient reaches one of those conversions (or a plain tensor's ``from_local``) in another
placement than the one it leaves with. :class:`TPTracer` hooks the styled modules during the
planner's meta forward of the unparallelized model and follows each tensor from module to
module by identity: a plain tensor, or a DTensor with a placement and the *boundary* (the
conversion) its gradient will come back through. The consumer of a DTensor says in which
placement that gradient arrives (a colwise Linear gives a partial sum for its replicated input,
a rowwise one a shard of the last dim, a sequence-parallel norm a sequence shard). What each
conversion costs, as DTensor carries it out (torch 2.13):

- ``Shard(d) -> Replicate``: an all-gather of the local shard, padded to ``ceil(n / T)`` rows;
- ``Partial -> Replicate``: an all-reduce of the whole tensor;
- ``Partial -> Shard(d)``: a reduce-scatter of the whole tensor, padded to a multiple of T;
- ``Shard(a) -> Shard(b)``: an all-to-all (on gloo an all-gather, then a local chunk);
- to ``Replicate`` or ``Shard`` from ``Replicate``: local, nothing sent.

Backward follows torch's rules: a ``from_local`` takes the gradient back to its layout (a
partial one as replicated); a redistribution back to the layout it started from, except that a
partial start becomes replicated unless the gradient is itself partial. A parameter a
sequence-parallel style replicates gets a partial gradient (each rank saw part of the
sequence), which the engine's sharding extension all-reduces over tp before the dp reduction.

*Approximate*: a DTensor consumed by code outside the plan's styles is taken to come back in
its own placement; a tensor used by two styled modules keeps the first one's gradient layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.tools.plan.tp_styles import StyleRole, check_shardable, style_role

__all__ = ["TPCall", "TPSchedule", "TPTracer"]


@dataclass(frozen=True, slots=True)
class TPCall:
    """One collective on the tp axis."""

    kind: str
    """'all_gather', 'reduce_scatter', 'all_reduce' or 'all_to_all'."""
    module: str
    """The styled module whose boundary it converts (for parameter gradients: the parameter)."""
    input_bytes: int
    """What this rank contributes (the functional collective's input)."""
    sent_bytes: int
    """What it sends under a bandwidth-optimal algorithm."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TPSchedule:
    """The tp collectives of one step, placed on the forward's segments."""

    forward: dict[int, list[TPCall]]
    """Segment -> the forward's collectives there, in order."""
    backward: dict[int, list[TPCall]]
    """Segment -> backward's collectives there, in backward's order."""
    partial_grads: frozenset[str]
    """Parameters whose gradient is a partial sum over tp (all-reduced before dp reduces)."""


@dataclass(slots=True)
class _Tensor:
    """What a traced tensor is in the parallel run: its size, placement and boundary."""

    shape: tuple[int, ...]
    itemsize: int
    requires_grad: bool


@dataclass(slots=True)
class _Boundary:
    """A conversion whose backward converts the gradient (see the module docstring)."""

    module: str
    segment: int
    tensor: _Tensor
    start: Placement
    """The layout the gradient is taken back to (before backward's rule)."""
    redistribution: bool
    """True for a redistribution, False for a ``from_local``."""
    grad: Placement | None = None
    """The gradient's placement, once a consumer says."""


@dataclass(slots=True)
class _DTensor:
    placement: Placement
    boundary: _Boundary | None


@dataclass(slots=True)
class _Trace:
    forward: dict[int, list[TPCall]] = field(default_factory=dict)
    boundaries: list[_Boundary] = field(default_factory=list)


class TPTracer:
    """Follows the styled modules through a meta forward; :meth:`schedule` afterwards.

    Args:
        resolved: FQN -> (module, style), from ``tp_styles.resolve_plan``.
        tp_degree: Ranks of the tp axis.
        gloo: Whether the backend is gloo (no all-to-all: DTensor gathers instead).
    """

    def __init__(
        self, resolved: Mapping[str, tuple[nn.Module, ParallelStyle]], tp_degree: int, gloo: bool
    ) -> None:
        self._resolved = resolved
        self._roles = {fqn: style_role(fqn, m, s) for fqn, (m, s) in resolved.items()}
        self._tp, self._gloo = tp_degree, gloo
        self._dtensors = WeakIdKeyDictionary()  # meta tensor -> _DTensor
        self._trace = _Trace()
        self._segment: Callable[[], int] = lambda: 0
        self._prepared: dict[str, Placement] = {}  # module -> its first input's layout inside

    @contextmanager
    def hooks(self, segment: Callable[[], int]) -> Iterator[None]:
        """Hook the styled modules while the forward runs; ``segment()`` says where it is."""
        self._segment = segment
        handles = []
        for fqn, (module, _) in self._resolved.items():
            role = self._roles[fqn]
            handles.append(module.register_forward_pre_hook(self._pre(role)))
            handles.append(module.register_forward_hook(self._post(role)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def schedule(self) -> TPSchedule:
        """The collectives recorded, backward's placed on the segments they were created in."""
        backward: dict[int, list[TPCall]] = {}
        for boundary in reversed(self._trace.boundaries):
            call = self._backward_call(boundary)
            if call is not None:
                backward.setdefault(boundary.segment, []).append(call)
        return TPSchedule(
            forward=self._trace.forward, backward=backward, partial_grads=self._partial_grads()
        )

    # --- forward -------------------------------------------------------------------------

    def _pre(self, role: StyleRole) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            for i, (layout, wanted) in enumerate(role.inputs):
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    self._prepare_input(role, args[i], layout, wanted, first=i == 0)

        return hook

    def _prepare_input(
        self,
        role: StyleRole,
        tensor: torch.Tensor,
        layout: Placement | None,
        wanted: Placement | None,
        first: bool,
    ) -> None:
        known: _DTensor | None = self._dtensors.get(tensor)
        if known is None and layout is None:
            return
        info = _Tensor(tuple(tensor.shape), tensor.element_size(), tensor.requires_grad)
        for placement in (layout, wanted):
            self._check(role, info, placement, "input")
        boundary: _Boundary | None
        if known is None:
            assert layout is not None
            placement, boundary = layout, self._boundary(role, info, layout, False)
        else:
            placement, boundary = known.placement, known.boundary
        if wanted is not None and not _same(placement, wanted, len(info.shape)):
            self._forward_call(role, info, placement, wanted)
            placement, boundary = wanted, self._boundary(role, info, placement, True)
        if role.prepares_only:  # the prepared DTensor goes on into the module
            self._hand_on(tensor, role, placement, boundary)
        elif first:
            if boundary is not None and boundary.grad is None and role.input_grad is not None:
                boundary.grad = role.input_grad
            self._prepared[role.fqn] = placement

    def _post(self, role: StyleRole) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or role.prepares_only:
                return
            info = _Tensor(tuple(output.shape), output.element_size(), output.requires_grad)
            placement = role.produces
            if placement is None:  # the output keeps the prepared input's layout
                placement = self._prepared.get(role.fqn, role.inputs[0][1] or Replicate())
            for layout in (placement, role.output):
                self._check(role, info, layout, "output")
            boundary = None
            if role.output is not None and not _same(placement, role.output, len(info.shape)):
                self._forward_call(role, info, placement, role.output)
                boundary = self._boundary(role, info, placement, True)
                placement = role.output
            self._hand_on(output, role, placement, boundary)

        return hook

    def _check(
        self, role: StyleRole, info: _Tensor, placement: Placement | None, what: str
    ) -> None:
        if placement is not None:
            check_shardable(f"{role.fqn or '<root>'}'s {what}", info.shape, placement, self._tp)

    def _hand_on(
        self,
        tensor: torch.Tensor,
        role: StyleRole,
        placement: Placement,
        boundary: _Boundary | None,
    ) -> None:
        if role.local_output:
            # to_local: the gradient comes back as a DTensor of this (settled) layout.
            if boundary is not None and boundary.grad is None:
                boundary.grad = _settled(placement)
        else:
            self._dtensors[tensor] = _DTensor(placement, boundary)

    def _boundary(
        self, role: StyleRole, info: _Tensor, start: Placement, redistribution: bool
    ) -> _Boundary:
        boundary = _Boundary(role.fqn, self._segment(), info, start, redistribution)
        self._trace.boundaries.append(boundary)
        return boundary

    def _forward_call(self, role: StyleRole, info: _Tensor, src: Placement, dst: Placement) -> None:
        call = _conversion(role.fqn, info, src, dst, self._tp, self._gloo)
        if call is not None:
            self._trace.forward.setdefault(self._segment(), []).append(call)

    # --- backward ------------------------------------------------------------------------

    def _backward_call(self, boundary: _Boundary) -> TPCall | None:
        grad = boundary.grad
        if grad is None or not boundary.tensor.requires_grad:
            return None
        target = boundary.start
        if not boundary.redistribution or not grad.is_partial():
            target = _settled(target)
        return _conversion(boundary.module, boundary.tensor, grad, target, self._tp, self._gloo)

    def _partial_grads(self) -> frozenset[str]:
        names = set()
        for fqn, (module, style) in self._resolved.items():
            if isinstance(style, SequenceParallel):
                for name, param in module.named_parameters():
                    if param.requires_grad:
                        names.add(f"{fqn}.{name}" if fqn else name)
        return frozenset(names)


def _settled(placement: Placement) -> Placement:
    """A partial layout as a gradient comes back in it: replicated."""
    return Replicate() if placement.is_partial() else placement


def _same(a: Placement, b: Placement, ndim: int) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim % ndim == b.dim % ndim
    return a == b


def _conversion(
    module: str, info: _Tensor, src: Placement, dst: Placement, tp: int, gloo: bool
) -> TPCall | None:
    """The collective that takes ``info`` from ``src`` to ``dst`` on the tp axis, if any."""
    ndim = len(info.shape)
    if _same(src, dst, ndim) or src.is_replicate() or isinstance(dst, Partial) or tp == 1:
        return None
    numel = math.prod(info.shape)
    b = info.itemsize
    if isinstance(src, Shard):
        dim = src.dim % ndim
        rows = -(-info.shape[dim] // tp)  # every rank sends a padded shard
        shard = rows * (numel // info.shape[dim] if info.shape[dim] else 0) * b
        if dst.is_replicate() or gloo:
            return TPCall("all_gather", module, shard, shard * (tp - 1))
        return TPCall("all_to_all", module, shard, shard * (tp - 1) // tp)
    assert src.is_partial()
    if dst.is_replicate():
        return TPCall("all_reduce", module, numel * b, 2 * numel * b * (tp - 1) // tp)
    assert isinstance(dst, Shard)
    dim = dst.dim % ndim
    padded = -(-info.shape[dim] // tp) * tp * (numel // info.shape[dim] if info.shape[dim] else 0)
    return TPCall("reduce_scatter", module, padded * b, padded * b * (tp - 1) // tp)
