"""The order groups run in and what activations cost: from a step on the meta device.

A forward is cut into *segments* by the groups' pre- and post-forward events: segment ``j``
lies between event ``j-1`` and event ``j``. Backward walks the same segments in reverse, so
the engine's backward events are the forward ones mirrored (a post-forward becomes the
pre-backward hook on that module's output).

With example inputs, :func:`trace_step` runs the model forward on the meta device (nothing is
allocated) with the parameters replaced by meta tensors of the gather dtype, and records:

- the events, in the order the forward hooks fire (inputs cast to ``param_dtype`` at each
  group, as the engine does);
- the bytes autograd saves for backward, counted by unique storage in the segment that first
  saved it, *excluding* parameter and buffer storages (those are not activations), plus the
  model's output (what the loss saves is counted apart); ``scaled_dot_product_attention``
  counts what a fused (flash) kernel saves, not the math fallback's (B, H, T, T) scores;
- for each parameter, the segments where it is first and last used: its gradient appears
  when backward reaches the last use and is complete at the first;
- then the loss (``PlanOptions.loss``, or a unit loss on the outputs) and backward, also on
  the meta device, for the memory of each segment's backward (see ``backward``).

Without inputs, :func:`assumed_trace` orders events as the module tree is registered and saves
nothing.

Where in backward each gradient appears and each group reduces, read from a finished trace, is
``gradient_schedule``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.tools.plan.backward import (
    BackwardSegment,
    SegmentCursor,
    attention_call,
    backward_profile,
    fused_attention,
    unit_loss,
)
from shardkit.tools.plan.call_modes import FunctionCalls, RunCall
from shardkit.tools.plan.group_hooks import group_hooks
from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.op_costs import CostCounter, StepCosts
from shardkit.tools.plan.options import PlanOptions, loss_takes_model
from shardkit.tools.plan.recompute import checkpointed_forwards

__all__ = [
    "ForwardWatch",
    "GroupEvent",
    "MetaStepTrace",
    "assumed_trace",
    "trace_step",
]


@dataclass(frozen=True, slots=True)
class GroupEvent:
    """A group's pre- or post-forward, by index into the plan's groups."""

    kind: Literal["pre", "post"]
    group: int
    needs_grad: bool = True
    """Whether a tensor crossing it requires grad. The engine's pre-backward hook sits on
    the outputs that do: a post-forward with none is never mirrored in backward."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MetaStepTrace:
    """What a step's forward did on the meta device, segment by segment (the planner's trace).

    Made by :func:`trace_step`, or by :func:`assumed_trace` without inputs; not the engine's
    ``StepTrace`` (``shardkit.core.engine.step_trace``), which records a real step's events.
    """

    events: tuple[GroupEvent, ...]
    """Group events in forward order."""
    activation_bytes: tuple[int, ...]
    """Bytes first saved in each segment (``len(events) + 1`` of them)."""
    loss_bytes: int = 0
    """What the loss saves for backward (after forward: not activations of the model)."""
    backward: tuple[BackwardSegment, ...] | None = None
    """Memory while backward runs each segment (None: not measured; then each segment's
    activations are freed when backward leaves it and nothing else is counted)."""
    uses: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter FQN -> (first, last) segment using it; empty when not traced."""
    traced: bool = False
    """Whether this came from a real (meta) forward."""
    model_events: int | None = None
    """How many of ``events`` the model's forward made; the rest are the loss's calls of the
    model's modules (a chunked loss through the output head). None: all of them."""
    costs: StepCosts | None = None
    """The operators of forward and backward, by segment and module (``op_costs``)."""


def assumed_trace(model: nn.Module, groups: list[GroupSpec]) -> MetaStepTrace:
    """Events in module registration order (a group runs its children in order), no saves.

    A group of several modules starts at the first of them and ends after the last.
    """
    index = {id(m): i for i, g in enumerate(groups) for m in g.call_modules}
    left = [len(g.call_modules) for g in groups]  # modules of each group yet to run
    events: list[GroupEvent] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        group = index.get(id(module))
        if group is not None and left[group] == len(groups[group].call_modules):
            events.append(GroupEvent("pre", group))
        for child in module.children():
            visit(child)
        if group is not None:
            left[group] -= 1
            if not left[group]:
                events.append(GroupEvent("post", group))

    visit(model)
    return MetaStepTrace(events=tuple(events), activation_bytes=(0,) * (len(events) + 1))


class _Recorder:
    """Collects events, saved storages and parameter uses during the meta forward."""

    def __init__(self, excluded: set[int], params: dict[int, str]) -> None:
        self.events: list[GroupEvent] = []
        # Saved storages -> segment of the first save. Weak: a storage freed in forward
        # (never saved again) must not be mistaken for a new one that reuses its address.
        self.saved = WeakIdKeyDictionary()  # storage -> (segment, saved by the loss)
        self.model_events: int | None = None  # events of the model's forward (then the loss's)
        self.excluded = excluded  # parameter and buffer storages (alive all along)
        self.params = params  # id of a replacement parameter tensor -> FQN
        self.uses: dict[str, tuple[int, int]] = {}
        self.cursor = SegmentCursor()  # backward's position, moved by hooks set here
        # The model's output, held through the loss (the training step holds it there), so
        # that it counts as forward's even when no op saves it.
        self.outputs: list[torch.UntypedStorage] = []

    @property
    def in_loss(self) -> bool:
        """Whether the loss runs now: what it saves is not the model's activations."""
        return self.model_events is not None

    @property
    def segment(self) -> int:
        return len(self.events)

    def save(self, tensor: torch.Tensor, segment: int | None = None) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse or opaque tensors: no storage to count
        if storage._cdata not in self.excluded and storage not in self.saved:
            self.saved[storage] = (self.segment if segment is None else segment, self.in_loss)

    def event(self, kind: Literal["pre", "post"], group: int, crossing: Any) -> None:
        """A group event; ``crossing`` holds the tensors passed across it."""
        needs_grad = False
        for t in pytree.tree_leaves(crossing):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # Hooked, not kept: holding the tensor would keep it alive through backward.
                t.register_hook(self.cursor.hook(self.segment))
                needs_grad = True
        self.events.append(GroupEvent(kind, group, needs_grad))

    def use(self, tensors: list[Any]) -> None:
        for t in tensors:
            name = self.params.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is not None:
                first = self.uses.get(name, (self.segment, self.segment))[0]
                self.uses[name] = (first, self.segment)

    def activation_bytes(self) -> tuple[int, ...]:
        per_segment = [0] * (len(self.events) + 1)
        for storage, (segment, in_loss) in self.saved.items():
            if not in_loss:
                per_segment[segment] += storage.nbytes()
        return tuple(per_segment)

    def loss_bytes(self) -> int:
        return sum(st.nbytes() for st, (_, in_loss) in self.saved.items() if in_loss)


def _traced_call(recorder: _Recorder) -> RunCall:
    """Notes every torch call that takes a (replacement) parameter; runs attention as fused.

    On the meta device ``scaled_dot_product_attention`` would fall back to the math kernel,
    which saves (and in backward differentiates) the (B, H, T, T) scores; GPUs run a fused
    kernel, which :class:`FusedAttention` stands in for.
    """

    def run(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recorder.use(pytree.tree_leaves((args, kwargs)))
        call = attention_call(func, args, kwargs)
        if call is not None:
            return fused_attention(call.query, call.key, call.value)
        return func(*args, **kwargs)

    return run


class ForwardWatch(Protocol):
    """Something else to hook during the meta forward (the tensor-parallel tracer)."""

    def hooks(self, segment: Callable[[], int]) -> AbstractContextManager[None]:
        """Hooks held while the forward runs; ``segment()`` is the current segment."""


def trace_step(
    model: nn.Module,
    groups: list[GroupSpec],
    options: PlanOptions,
    watch: ForwardWatch | None = None,
) -> MetaStepTrace:
    """Run ``model`` forward, the loss and backward on the meta device, and record.

    The model runs unparallelized: parameters are replaced by meta tensors of their full
    shape, in the gather dtype. ``watch``'s hooks, installed before the group events', run
    first, as tensor parallelism's (applied before ``fully_shard``) do.

    Raises:
        TypeError: ``options.inputs`` returns something other than a tensor, tuple or dict.
        RuntimeError: the forward or the loss fails on the meta device (the message says so).
    """
    assert options.inputs is not None
    args, kwargs = _as_call(options.inputs())
    replacements: dict[str, torch.Tensor] = {}
    param_names: dict[int, str] = {}
    shapes = {name: param.shape for name, param in model.named_parameters()}
    for g in groups:
        for p in g.params:
            fake = torch.empty(shapes[p.fqn], dtype=p.comm_dtype, device="meta")
            fake.requires_grad_(p.requires_grad)
            replacements[p.fqn] = fake
            param_names[id(fake)] = p.fqn
    excluded = {t.untyped_storage()._cdata for t in replacements.values()}
    excluded |= {b.untyped_storage()._cdata for b in model.buffers()}
    recorder = _Recorder(excluded, param_names)
    root_is_group = any(g.module is model for g in groups)
    step = _ForwardThenLoss(model, recorder, options.loss, root_is_group)
    prefixed = {f"model.{name}": fake for name, fake in replacements.items()}
    counter = CostCounter(lambda: recorder.segment, lambda: recorder.cursor.segment)
    # The replacement parameters stay in place through backward too: a checkpointed module
    # reruns its forward there, on the parameters backward gathers (the gather dtype).
    with _reparametrize_module(step, prefixed, tie_weights=True):
        with ExitStack() as stack:
            if watch is not None:
                stack.enter_context(watch.hooks(lambda: recorder.segment))
            stack.enter_context(group_hooks(groups, recorder.event, options.param_dtype))
            stack.enter_context(checkpointed_forwards(model, options, recorder.save))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(saved_tensors_hooks(_packer(recorder), lambda t: t))
            stack.enter_context(FunctionCalls(_traced_call(recorder)))
            stack.enter_context(counter.counting(model))
            loss = step(*args, **kwargs)
        activations, loss_bytes = recorder.activation_bytes(), recorder.loss_bytes()
        recorder.outputs.clear()  # the step's caller drops the output once the loss is made
        profile = None
        counter.in_backward = True
        if loss is not None:
            with counter.counting():
                profile = backward_profile(
                    loss, recorder.cursor, recorder.saved, replacements, len(activations)
                )
    return MetaStepTrace(
        events=tuple(recorder.events),
        activation_bytes=activations,
        loss_bytes=loss_bytes,
        backward=profile,
        uses=dict(recorder.uses),
        traced=True,
        model_events=recorder.model_events,
        costs=counter.costs(len(activations)),
    )


class _ForwardThenLoss(nn.Module):
    """The model's forward and then the loss, as one call with the replacement parameters.

    A loss may call the model's own modules after its forward (a chunked cross-entropy runs
    the output head on slices of the hidden states), which must see the same replacement
    parameters as the forward: their gradients and their group events are the step's.
    """

    def __init__(
        self,
        model: nn.Module,
        recorder: _Recorder,
        loss_fn: Callable[..., torch.Tensor] | None,
        root_is_group: bool,
    ) -> None:
        super().__init__()
        self.model = model
        self._recorder, self._loss_fn, self._root_is_group = recorder, loss_fn, root_is_group

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        recorder = self._recorder
        output = _run("forward", lambda: self.model(*args, **kwargs))
        # The output exists before the root's post-forward event (when the root is a group).
        _save_output(recorder, output, recorder.segment - (1 if self._root_is_group else 0))
        recorder.model_events = recorder.segment  # the loss from here
        # Returning drops ``output``: only the loss's graph holds it now, as in training.
        return _loss(output, self._loss_fn, self.model)


def _save_output(recorder: _Recorder, output: Any, segment: int) -> None:
    # A function of its own: a loop variable left behind would keep the output alive.
    for tensor in pytree.tree_leaves(output):
        if isinstance(tensor, torch.Tensor):
            recorder.save(tensor, segment)
            recorder.outputs.append(tensor.untyped_storage())


def _run(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as err:
        raise RuntimeError(
            f"shardkit.tools.plan: the {what} failed on the meta device: {err}"
        ) from err


def _loss(
    output: Any, loss_fn: Callable[..., torch.Tensor] | None, model: nn.Module
) -> torch.Tensor | None:
    """The scalar to backpropagate, or None when nothing in the output needs a gradient."""
    if loss_fn is not None:
        call_args = (output, model) if loss_takes_model(loss_fn) else (output,)
        loss = _run("loss", lambda: loss_fn(*call_args))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("shardkit.tools.plan: PlanOptions.loss must return a scalar tensor")
        return loss if loss.requires_grad else None
    leaves = pytree.tree_leaves(output)
    differentiable = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return unit_loss(differentiable) if differentiable else None


def _packer(recorder: _Recorder) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        recorder.save(tensor)
        return tensor

    return pack


def _as_call(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments from what ``inputs()`` returned, moved to meta."""
    if isinstance(value, torch.Tensor):
        args: tuple[Any, ...] = (value,)
        kwargs: dict[str, Any] = {}
    elif isinstance(value, tuple | list):
        args, kwargs = tuple(value), {}
    elif isinstance(value, dict):
        args, kwargs = (), dict(value)
    else:
        raise TypeError(
            "shardkit.tools.plan: inputs() must return a tensor, a tuple of positional "
            f"arguments or a dict of keyword arguments, got {type(value).__name__}"
        )
    # Real tensors are fine to pass (say, a batch from the data loader): meta copies of them
    # are what the forward needs, and they allocate nothing.
    moved: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.is_meta else t.to("meta"), (args, kwargs)
    )
    return moved
