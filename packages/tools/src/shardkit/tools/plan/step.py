"""One steady-state training step of shardkit's engine, simulated from shapes alone.

The simulation follows the engine's hooks over the forward's segments (see ``trace``):
forward through the group events in order, backward through them mirrored, then the optimizer.
It issues the collectives the engine issues, in its order, and keeps a ledger of every buffer
the engine allocates, sampling live bytes by category at each allocation (frees only lower the
total, so the peak is always at an allocation).

Modelling assumptions (each one what the engine does, unless marked *approximate*):

- Steady state: the second or a later step. Optimizer state exists; gradients were set to None
  by ``zero_grad()``; forward prefetches the next group in last step's order (the first step
  has no order yet and does not prefetch); backward prefetches the previous group in
  post-forward order.
- Parameters are gathered at pre-forward (or found prefetched), freed at post-forward when the
  group reshards after forward, gathered again at pre-backward, and freed after the group's
  reduce-scatter; the root keeps its parameters through backward unless
  ``reshard_after_forward=True`` is given explicitly. A group with no trainable parameter
  reshards once backward has passed its (first) pre-forward, where its inputs' gradients are
  made; one whose inputs need none stays gathered until the end-of-backward callback. A
  group whose outputs need no gradient is never gathered in backward (not even prefetched).
  With ``PlanOptions.units``, each unit's own ``reshard_after_forward`` (the root's too: a
  unit always gives one; an int n between 1 and the shard count keeps the engine's 1/n
  post-forward slices, gathered in backward within n ranks on ``SLICE_AXIS``), and a unit of
  several modules is one group, gathered at the first
  of its modules to run and ended after the last (``group_hooks``); with ``prefetch`` > 1,
  every group's explicit prefetch lists replace the engine's next-group rule.
- Activation checkpointing (``recompute``): what a checkpointed module keeps and recomputes
  is measured by running torch's checkpoint in the meta trace; the recomputation's tensors
  are backward's own bytes (category OTHER), as the trackers count them.
- CPU offload (``offload``): sharded parameters, sharded gradients, optimizer state and the
  optimizer's scratch in host memory (``MemoryPoint.host_by_category``), outside the device's
  categories; the all-gather input staged on the device (the core's
  ``stages_gather_input(offload=True)``).
- Buffers, every size from the core's layout (``GroupSpec.layout``): sharded parameters (one
  aligned flat buffer per group); the all-gather's staging copy of it when ``param_dtype``
  differs (the core's ``stages_gather_input``; on gloo only: elsewhere the copy goes into
  this rank's row of the receive buffer) and its receive buffer, both from issue to
  copy-out (on one shard rank a cast goes straight into the unsharded buffer); the unsharded
  flat buffer; the reduce-scatter send buffer (W rows) and, on gloo
  with W > 2, W-1 received rows and their sum. The buffer pool keeps one idle buffer per
  size that two or more groups borrow (the core's ``pooled_sizes``), in forward only.
- At most one reduction is in flight (the engine's default, ``MAX_REDUCES_IN_FLIGHT``): when the
  next group's reduction starts, it first finishes the one in flight (wait, all-reduce across
  HSDP replicas, divide, assign the output as the sharded gradients) and returns that one's
  send buffer, and only then allocates its own buffers. The root's end-of-backward callback
  (``finish_reductions``) finishes the last reduction the same way.
- Gradients: autograd's unsharded gradients (gather dtype) appear when backward reaches a
  parameter's last use and are freed once the group's reduce-scatter has packed them; the
  reduce-scatter output is the sharded gradient (cast to the parameters' dtype if the reduce
  dtype differs) and lives until ``zero_grad()``.
- Optimizer: AdamW's two states and a 4-byte ``step`` per trainable parameter, each state the
  size of the rank's unpadded local shard. *Approximate*: the step's scratch (two
  largest-shard temporaries per tensor on the CPU, one state's worth for foreach on GPUs).
  Muon (``muon_step``): one state for the matrices outside the root, and its step's whole
  matrices on their owners (*approximate*), AdamW's for the rest.
- Tensor parallelism (``tp_comm``): each forward segment's tp collectives are issued in it,
  backward's while backward runs that segment; the partial gradients of sequence-parallel
  parameters are all-reduced over tp as their group starts its reduction (the engine's
  sharding extension settles them first). Buffers are the TP-local ones (the layout is asked
  with TP-local shapes); activations are the unparallelized model's (*approximate*, high).
- Activations (*approximate*, from the meta forward and backward of ``trace``): forward
  adds each segment's saved bytes at the segment's end; backward follows the measured live
  saved bytes and activation gradients (category OTHER) segment by segment. Allocator
  rounding and caching are in ``MemoryPlan.allocated_peak``/``reserved_peak``
  (``caching_allocator``), not in the live bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardkit.core.conditional_schedule import ConditionalDriver
from shardkit.core.layout import step_checks_on
from shardkit.core.schedule import (
    StepDriver,
    StepSchedule,
    TrainingState,
    count_can_end_backward,
    watches_inputs,
)
from shardkit.tools.plan.gradient_schedule import gradient_schedule
from shardkit.tools.plan.muon_step import muon_exchange_calls, state_tensors, step_scratch
from shardkit.tools.plan.offload import free_resident, resident
from shardkit.tools.plan.records import CollectiveCall, MemoryPlan, StepMark
from shardkit.tools.plan.step_inputs import StepInputs
from shardkit.tools.plan.step_ops import LedgerOps
from shardkit.tools.records import Category, Phase

__all__ = ["StepResult", "simulate_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """The simulated step."""

    schedule: tuple[CollectiveCall, ...]
    """Every collective, in issue order."""
    step_check: tuple[CollectiveCall, ...]
    """The step check's messages where the backward ends (the core's ``runtime/watch/step_check``),
    after ``schedule``: not collectives of the step's, and announced by no event."""
    memory: MemoryPlan
    """The ledger's samples, peak and per-category maxima."""
    reshard_after_forward: tuple[bool, ...]
    """Per group: whether it frees its parameters after forward."""
    events: tuple[tuple[str, str], ...] = ()
    """The engine's events in order, (what, group): its state transitions ('pre_forward',
    'unshard', 'reshard', 'post_forward', 'pre_backward', 'post_backward', the names of
    ``shardkit.core.StateTransitionEvent``) and its data-parallel collectives ('all_gather',
    'reduce_scatter', 'all_reduce')."""
    marks: tuple[StepMark, ...] = ()
    """Compute, collectives and waits in program order, for the step's timing."""


def simulate_step(inputs: StepInputs) -> StepResult:
    """Run the step: forward, backward, optimizer."""
    step = _Step(inputs)
    step.setup()
    step.forward()
    step.backward()
    step.optimizer()
    points = tuple(step.ledger.points)
    peak = max(points, key=lambda p: p.total)
    category_max = {c: max(p.by_category[c] for p in points) for c in Category}
    return StepResult(
        schedule=tuple(step.ops.calls),
        step_check=tuple(step.ops.check_calls),
        memory=MemoryPlan(
            peak=peak,
            category_max=category_max,
            timeline=points,
            allocated_peak=step.ledger.blocks.allocator.peak_allocated,
            reserved_peak=step.ledger.blocks.allocator.peak_reserved,
        ),
        reshard_after_forward=tuple(
            step.ops.settings(i).reshard_after_forward is not False for i in range(len(step.groups))
        ),
        events=tuple(step.ops.events),
        marks=tuple(step.ops.marks),
    )


class _Step:
    """The engine's step on sizes: the trace replayed through the engine's ``StepDriver``.

    This class reports what the model's forward and autograd would (each module's hooks, each
    gradient's arrival, activations by segment); the driver decides which operation follows,
    and ``step_ops.LedgerOps`` does it on the ledger. The order of the operations at each hook
    is the driver's, never restated here.
    """

    def __init__(self, inputs: StepInputs) -> None:
        self.inputs = inputs
        self.groups = inputs.groups
        self.ops = LedgerOps(inputs)
        self.ledger = self.ops.ledger
        events = inputs.trace.events
        # Steady state: the previous step ran forward in the order this one does.
        # Forward prefetch follows the root's forward alone, not the loss's calls after it.
        self.model_events = (
            len(events) if inputs.trace.model_events is None else inputs.trace.model_events
        )
        schedule: StepSchedule[int] = StepSchedule()
        inside = events[: self.model_events]
        anchoring = inputs.anchoring
        # Conditional groups take no place in the orders prefetch follows (``conditional``).
        marked = frozenset(anchoring.marked if anchoring is not None else ())
        schedule.forward_order = [
            e.group for e in inside if e.kind == "pre" and e.group not in marked
        ]
        self.driver: StepDriver[int] = (
            StepDriver(self.ops, schedule)
            if anchoring is None
            else ConditionalDriver(self.ops, anchoring, schedule)
        )
        # Inner anchors: the engine watches their inputs, and backward through them ends them.
        self.inner_anchors = frozenset(anchoring.inner() if anchoring is not None else ())
        self.first_pre: dict[int, int] = {}
        self.inputs_need_grad: set[int] = set()
        for index, event in enumerate(events):
            if event.kind == "pre":
                self.first_pre.setdefault(event.group, index)
                if event.needs_grad:
                    self.inputs_need_grad.add(event.group)
        self.grads_in: set[int] = set()  # groups whose every trainable gradient is in

    # --- persistent state ------------------------------------------------------------------

    def setup(self) -> None:
        options = self.inputs.options
        shard_rank = self.inputs.shard_rank
        ledger = self.ledger
        if self.inputs.buffer_bytes:
            ledger.alloc(("buffers", 0), Category.OTHER, self.inputs.buffer_bytes, "module buffers")
        for i, g in enumerate(self.groups):
            ledger.module = g.fqn
            layout = g.layout
            nbytes, offload = layout.sharded_bytes, options.offload
            key = ("sharded", i)
            resident(ledger, key, Category.SHARDED_PARAMS, nbytes, "sharded", offload=offload)
            state = sum(self._states(i, p.shape) * p.local_numel(shard_rank) * p.dtype.itemsize
                        + (4 if self._states(i, p.shape) == 2 else 0)  # Adam's float32 step
                        for p in g.trainable)  # fmt: skip
            if state:
                label = "optimizer state"
                key = ("optim", i)
                resident(ledger, key, Category.OPTIMIZER_STATE, state, label, offload=offload)
            if options.keep_unsharded_storage:  # held since the first step's unshard
                self.ops.hold_unsharded(i, f"unsharded {g.fqn} (kept)")

    def _states(self, group: int, shape: Sequence[int]) -> int:
        return state_tensors(self.inputs.options, shape, in_root=group == self.inputs.root)

    # --- forward ---------------------------------------------------------------------------

    def forward(self) -> None:
        ledger, trace = self.ledger, self.inputs.trace
        ledger.phase = Phase.FORWARD
        self.driver.root_pre_forward()
        owners = self._segment_owners()
        for j, nbytes in enumerate(trace.activation_bytes):
            if j == self.model_events:  # the model's forward returns; a loss may call more
                self.driver.root_post_forward(range(len(self.groups)))
            ledger.module = owners[j]
            self.ops.mark("compute", j)
            if nbytes:
                ledger.alloc(("act", j), Category.ACTIVATIONS, nbytes, "activations")
            self.ops.record_tp(self.inputs.tp.forward.get(j, []) if self.inputs.tp else [])
            if j < len(trace.events):
                event = trace.events[j]
                ledger.module = self.groups[event.group].fqn
                if event.kind == "pre":
                    if event.group in self.inner_anchors and event.needs_grad:
                        self._watching_inputs(event.group)
                    if self.ops.state(event.group) is not TrainingState.FORWARD:
                        self.driver.pre_forward(event.group)  # (the first module of a list)
                else:
                    self.driver.post_forward(event.group)
                    if event.needs_grad:
                        self.driver.output_needs_grad(event.group)
        ledger.module = ""
        if trace.loss_bytes:  # then the loss, outside the model; backward takes it over
            ledger.alloc(("loss", 0), Category.OTHER, trace.loss_bytes, "loss")
            ledger.free(("loss", 0))

    def _watching_inputs(self, anchor: int) -> None:
        """The engine's watch of an inner anchor's inputs that need gradients (its hook)."""
        assert isinstance(self.driver, ConditionalDriver)
        self.driver.watching_inputs(anchor)

    def _segment_owners(self) -> list[str]:
        """The innermost group running in each segment ('' outside every group)."""
        owners, stack = [], [""]
        for event in self.inputs.trace.events:
            owners.append(stack[-1])
            if event.kind == "pre":
                stack.append(self.groups[event.group].fqn)
            elif len(stack) > 1:
                stack.pop()
        return [*owners, stack[-1]]

    # --- the driver's operations (``schedule.StepOps``) on group indices ---------------------

    # --- unshard / reshard -----------------------------------------------------------------

    # --- backward --------------------------------------------------------------------------

    def backward(self) -> None:
        ledger, trace = self.ledger, self.inputs.trace
        ledger.phase = Phase.BACKWARD
        schedule = gradient_schedule(trace, self.groups)
        owners = self._segment_owners()
        for j in range(len(trace.events), -1, -1):
            ledger.module = owners[j]
            self.ops.mark("compute", j)
            self._backward_segment(j, schedule.appear.get(j, []))
            for g in schedule.reduce.get(j, []):
                self.grads_in.add(g)  # rule 1 of the engine's backward: the count completes
                if not count_can_end_backward(fills_missing=self._fills(g)):
                    continue  # its inputs end it, or the callback
                pending = self._watched(g) and g in self.inputs_need_grad
                pending = pending and self.first_pre[g] < j - 1
                self.driver.grads_complete(g, inputs_pending=pending)
            event = trace.events[j - 1] if j > 0 else None
            if event is not None and event.kind == "post" and event.needs_grad:
                self.driver.pre_backward(event.group)
            elif event is not None and self._inputs_watched_at(event.group, j - 1):
                # Rule 2: backward is through the group's inputs at its first pre-forward.
                g = event.group
                complete = not self.groups[g].trainable or g in self.grads_in or self._fills(g)
                self.driver.inputs_done(g, count_complete=complete)
        for key in [k for k in ledger.live if k[0] in ("act", "backward_scratch")]:
            ledger.free(key)  # autograd is done: the graph and its gradients are gone
        ledger.module = ""
        # The callback's order is the engine's states' (outermost first): the root, then the
        # others in the module tree's order, where ``groups`` lists the root last.
        root = self.inputs.root
        order = [i for i in range(len(self.groups)) if i != root]
        callback_order = order if root is None else [root, *order]
        self.driver.final_callback(callback_order, last=True, assign_now=False)
        self.ops.record_step_check()

    def _watched(self, g: int) -> bool:
        """Whether the engine watches group ``g``'s inputs' gradients (``watches_inputs``)."""
        group = self.groups[g]
        frozen = len(group.trainable) < len(group.params)
        return g in self.inner_anchors or watches_inputs(
            frozen=frozen, fills_missing=self._fills(g)
        )

    def _fills(self, g: int) -> bool:
        """Whether group ``g`` reduces a missing gradient as zeros, as the engine's reducer.

        A planned step synchronizes gradients, with one reduce dtype; the step check decides.
        """
        group = self.groups[g]
        world = group.world * max(1, self.inputs.replicas)
        return step_checks_on() and world > 1 and bool(group.trainable)

    def _backward_segment(self, j: int, grads: list[tuple[int, int]]) -> None:
        """Activations, activation and parameter gradients, tp collectives, in backward of ``j``.

        ``grads``: (group, parameter) of the gradients the segment makes. With a measured
        profile, the gradients the segment made before its peak are there at
        the peak and the others come after it, as the segment's activations go.
        """
        self.ops.record_tp(self.inputs.tp.backward.get(j, []) if self.inputs.tp else [])
        ledger, trace = self.ledger, self.inputs.trace
        if trace.backward is None:
            self._grads_appear(grads)
            if trace.activation_bytes[j]:  # freed as backward leaves the segment
                ledger.free(("act", j))
            return
        profile = trace.backward[j]
        early = [(g, p) for g, p in grads if self._fqn(g, p) in profile.grads_at_peak]
        # Backward's measured levels replace forward's per-segment records: one key from now
        # (the same tensors: the allocator's replay keeps their blocks under it, newest last).
        activations, scratch = ("act", -1), ("backward_scratch", 0)
        forward = [k for k in ledger.live if k[0] == "act" and k[1] >= 0]
        ledger.blocks.merge(forward, activations)
        for key in forward:
            ledger.free(key)
        ledger.set(scratch, Category.OTHER, 0, "")  # the measured pair replaces what was left
        ledger.set(activations, Category.ACTIVATIONS, profile.activations, "activations")
        ledger.set(scratch, Category.OTHER, profile.scratch, "activation gradients")
        # The gradients made before the segment's peak are there at it, beside the levels
        # measured then (not beside forward's, which backward has been freeing meanwhile: in
        # a segment holding the whole model, every activation would count twice).
        self._grads_appear(early)
        # What is left when the segment is done stays through the group's reduce-scatter.
        ledger.set(activations, Category.ACTIVATIONS, profile.activations_after, "activations")
        ledger.set(scratch, Category.OTHER, profile.scratch_after, "activation gradients")
        self._grads_appear([gp for gp in grads if gp not in early])

    def _fqn(self, g: int, p: int) -> str:
        return self.groups[g].params[p].fqn

    def _grads_appear(self, grads: list[tuple[int, int]]) -> None:
        """The unsharded gradients of ``grads`` (group, parameter), in the gather dtype."""
        for g, p in grads:
            param = self.groups[g].params[p]
            nbytes = param.numel * param.comm_dtype.itemsize
            self.ledger.alloc(self.ops.grad_key(g, p), Category.GRADIENTS, nbytes, "gradient")

    def _inputs_watched_at(self, g: int, index: int) -> bool:
        """Whether backward goes through group ``g``'s watched inputs at event ``index``.

        The engine watches the inputs of a group with frozen parameters, or whose missing
        gradients are reduced as zeros; backward is through them at its first pre-forward event.
        """
        return self._watched(g) and g in self.inputs_need_grad and self.first_pre[g] == index

    # --- optimizer -------------------------------------------------------------------------

    def optimizer(self) -> None:
        options, ledger = self.inputs.options, self.ledger
        ledger.phase, ledger.module = Phase.OPTIMIZER, ""
        self.ops.mark("optimizer")
        shard_rank = self.inputs.shard_rank
        sizes = [p.local_numel(shard_rank) * p.dtype.itemsize for i, g in enumerate(self.groups)
                 for p in g.trainable if self._states(i, p.shape) == 2]  # fmt: skip
        scratch = 0
        if sizes:
            # Adam's denominator: per tensor on the CPU (sqrt, then divide: two temporaries),
            # one foreach list for all parameters on GPUs.
            scratch = sum(sizes) if not self.ops.gloo else 2 * max(sizes)
        if options.optimizer == "muon":  # Muon's step runs first, then AdamW's
            muon = step_scratch(self.inputs.muon)
            scratch = max(scratch, muon)
            for world, input_bytes, sent in muon_exchange_calls(self.inputs.muon):
                self.ops.record_optimizer_call("all_to_all", world, input_bytes, sent)
        if scratch:  # where the step runs: the host, when offloading
            key, label = ("optim_scratch", 0), "optimizer step scratch"
            resident(ledger, key, Category.OTHER, scratch, label, offload=options.offload)
            free_resident(ledger, key)
        for g in range(len(self.groups)):
            if ("sharded_grad", g) in ledger.live or ("sharded_grad", g) in ledger.host:
                free_resident(ledger, ("sharded_grad", g))
