"""The step-time model: a plan's operators and collectives replayed on a machine's speeds.

:func:`estimate_step_time` walks the plan's step in program order (``Plan.marks``, which the
planner's step simulation notes as the engine's schedule runs):

- each segment's compute runs on the compute stream, one operator after another, each at its
  roofline, ``max(flops / flop rate, bytes / memory bandwidth)``, plus the profile's launch
  overhead (``Hardware.launch_s``): a step of many small operators is bound by launches;
- a collective is issued where the engine issues it and runs on its axis' link for
  ``latency + sent bytes / bandwidth``, after the previous collective on that axis (one
  process group runs one collective at a time); a prefetched all-gather thus overlaps the
  compute before its wait, a reduce-scatter the next segments' backward; HSDP's collectives
  across replicas start once the shard axis' reduce-scatter of the group has landed;
- compute that needs a group's parameters waits for its all-gather to land (``wait``) and
  copies the rows out (the engine's copy-out, at memory bandwidth; a reduction's copy-in
  counts with its collective); a tensor-parallel collective is waited for at once (its
  result is the next operator's input);
- without overlap (``Hardware.overlap`` False) every collective adds its time where it is
  issued; with overlap, a collective still takes ``Hardware.contention`` of its time from
  the compute (a CPU's gloo threads move the bytes on the compute's cores), and the engine's
  own host work per collective (``Hardware.collective_overhead_s``) runs on the compute
  stream;
- a collective's time is its link's for its kind and bytes (``Link.seconds``: a measured
  curve where the profile has one); on a host whose allocator maps large buffers afresh
  (``Hardware.fresh_alloc_bytes``), the engine's buffers that large are paged in again
  every step, on the compute stream;
- recomputation: a checkpointed module's forward (``full``), or its operators other than
  matrix multiplies and attention (``selective``), runs again in the backward segment where
  its last forward operator ran; a ``selective`` checkpoint's policy costs
  ``Hardware.selective_op_s`` per operator of the module's forward, in forward and again in
  that backward segment;
- CPU offload: each all-gather first copies the unit's shards to the device (host link, one
  copy at a time each way), each reduce-scatter's output is copied back, and the optimizer
  runs on the host at its memory bandwidth;
- the step ends when every collective and copy has landed (the end-of-backward callback
  waits for them) and the optimizer has run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardkit.tools.plan.op_costs import Costs, OpCost, StepCosts
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.records import CollectiveCall, StepMark
from shardkit.tools.plan.timing.hardware import Hardware
from shardkit.tools.records import Phase

__all__ = ["StepTime", "costs_seconds", "estimate_step_time", "op_seconds"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """A training step's predicted time and where it goes (seconds, one rank)."""

    total_s: float
    """The step, from the first forward operator to the optimizer's last."""
    compute_s: float
    """Forward and backward operators, recomputation included, and the engine's copies out
    of all-gathers (not the optimizer)."""
    communication_s: float
    """Every collective's time on its link, whether hidden or not."""
    exposed_communication_s: float
    """Time compute stood waiting for collectives and copies (all of them without overlap)."""
    recompute_s: float
    """Of ``compute_s``: checkpointed modules' forward run again in backward."""
    offload_s: float
    """Host <-> device copies of offloaded shards and gradients, hidden or not."""
    optimizer_s: float
    """The optimizer's step (on the host when offloaded)."""
    kernels: int
    """Operators launched, recomputation included."""
    phases: dict[str, float]
    """Wall time of 'forward', 'backward' (to its last collective) and 'optimizer'."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {name: getattr(self, name) for name in self.__slots__}


def op_seconds(cost: OpCost, hardware: Hardware) -> float:
    """``cost.count`` operators at their roofline, each with its launch overhead."""
    dtype = cost.dtype or "float32"
    rate = hardware.flop_rate(dtype, attention=cost.attention)
    compute = cost.flops / rate if cost.flops else 0.0
    memory = cost.nbytes / hardware.bytes_rate(dtype)
    return cost.count * (max(compute, memory) + hardware.launch_s)


def costs_seconds(costs: Costs, hardware: Hardware) -> float:
    """Operators run one after another."""
    return sum(op_seconds(c, hardware) for c in costs)


def _host_seconds(costs: Costs, hardware: Hardware) -> float:
    """Operators run on the host: bytes at its memory bandwidth, its dispatch per operator."""
    rate = hardware.host_memory_gbps * 1e9
    return sum(c.count * (c.nbytes / rate + hardware.host_launch_s) for c in costs)


def estimate_step_time(plan: Plan, hardware: Hardware) -> StepTime:
    """Predict one steady-state training step of ``plan`` on ``hardware``.

    Raises:
        ValueError: the plan counted no operators (planned without ``PlanOptions.inputs``),
            or a checkpointed module ran none.
    """
    costs = plan.costs
    if costs is None:
        raise ValueError(
            "shardkit.tools.plan.estimate_step_time: the plan has no operator counts; plan "
            "with PlanOptions.inputs (a meta-device forward and backward counts them)"
        )
    replay = _Replay(plan, costs, hardware)
    for mark in plan.marks:
        replay.run(mark)
    return replay.result()


def _recompute(plan: Plan, costs: StepCosts, hardware: Hardware) -> tuple[float, int]:
    """Seconds and operators of recomputation: part of backward's segments already.

    The planner's meta backward runs torch's own checkpoint, so the operators it reruns are
    counted in the segments backward runs them in (``StepCosts.recompute`` holds them apart,
    to say how much of backward they are); they are not added again.
    """
    for fqn, _ in plan.options.checkpoint:
        if fqn not in costs.module_segment:
            raise ValueError(
                f"shardkit.tools.plan.estimate_step_time: checkpointed module {fqn!r} ran no "
                "operator in the plan's forward (is the FQN the model's?)"
            )
    seconds = sum((costs_seconds(c, hardware) for c in costs.recompute), 0.0)
    return seconds, sum(c.count for segment in costs.recompute for c in segment)


def _selective_policy_seconds(plan: Plan, costs: StepCosts, hardware: Hardware) -> dict[int, float]:
    """Segment -> seconds a ``selective`` checkpoint's policy adds there.

    Forward and backward alike: the policy sees each operator of the module's forward once
    in each.
    """
    seconds: dict[int, float] = {}
    if not hardware.selective_op_s:
        return seconds
    for fqn, mode in plan.options.checkpoint:
        if mode != "selective" or fqn not in costs.module_segment:
            continue
        operators = sum(c.count for c in costs.modules.get(fqn, ()))
        segment = costs.module_segment[fqn]
        seconds[segment] = seconds.get(segment, 0.0) + operators * hardware.selective_op_s
    return seconds


class _Replay:
    """The step's clocks: the compute stream's, each link's and each copy direction's."""

    def __init__(self, plan: Plan, costs: StepCosts, hardware: Hardware) -> None:
        self.plan, self.costs, self.hw = plan, costs, hardware
        self.recompute_s, _ = _recompute(plan, costs, hardware)
        self.kernels = costs.kernels
        self.offload = plan.options.offload and hardware.host_link is not None
        self.now = 0.0  # the compute stream
        self.busy: dict[str, float] = {}  # link (axis) or copy direction -> busy until
        self.gathered: dict[str, float] = {}  # group -> its last all-gather lands
        self.copy_out: dict[str, float] = {}  # group -> its gather's copy-out, at the wait
        self.reduced: dict[str, float] = {}  # group -> its last reduce-scatter lands
        self.compute_s = self.comm_s = self.waited_s = self.offload_s = self.optimizer_s = 0.0
        self.backward_start: float | None = None
        self.optimizer_start = 0.0
        self.policy_s = _selective_policy_seconds(plan, costs, hardware)  # segment -> seconds

    def run(self, mark: StepMark) -> None:
        if mark.phase is Phase.BACKWARD and self.backward_start is None:
            self.backward_start = self.now
        if mark.kind == "compute":
            self._compute(mark)
        elif mark.kind == "collective":
            self._collective(self.plan.schedule[mark.index])
        elif mark.kind == "wait":
            self._wait_until(self.gathered.get(mark.group, 0.0))
            copy = self.copy_out.pop(mark.group, 0.0)  # the engine's copy into the parameters
            self.now += copy
            self.compute_s += copy
        elif mark.kind == "optimizer":
            self._optimizer()

    def _compute(self, mark: StepMark) -> None:
        segment = mark.index
        if mark.phase is Phase.FORWARD:
            seconds = costs_seconds(self.costs.forward[segment], self.hw)
        else:
            seconds = costs_seconds(self.costs.backward[segment], self.hw)
        seconds += self.policy_s.get(segment, 0.0)  # in forward, and in the recomputation
        self.now += seconds
        self.compute_s += seconds

    def _wait_until(self, when: float) -> None:
        if when > self.now:
            self.waited_s += when - self.now
            self.now = when

    def _occupy(self, channel: str, ready: float, seconds: float) -> float:
        """Run ``seconds`` on ``channel`` once it is free and ``ready``; when it ends."""
        end = max(ready, self.busy.get(channel, 0.0)) + seconds
        self.busy[channel] = end
        return end

    def _collective(self, call: CollectiveCall) -> None:
        ready = self.now
        if call.axis == "dp_replicate":  # HSDP: across replicas, what the shard axis reduced
            ready = max(ready, self.reduced.get(call.group, 0.0))
        if self.offload and call.kind == "all_gather" and call.axis != "tp":
            ready = self._copy("h2d", ready, call.input_bytes)  # the shards to the device
        seconds = self.hw.link(call.axis, call.group_size).seconds(call.sent_bytes, call.kind)
        if call.axis != "tp":  # the engine issues it (not DTensor): its hooks, its buffers
            host = self.hw.collective_overhead_s + self._fresh_seconds(call)
            self.now += host
            self.compute_s += host
            ready = max(ready, self.now)
        # The engine's copies on flat buffers, read and written at memory speed: gradients
        # packed into the send buffer before a reduction, the gathered rows copied out into
        # the parameters once the all-gather is waited for.
        packed = 2 * call.input_bytes / self.hw.bytes_rate("float32")
        if call.kind == "reduce_scatter":
            seconds += packed
        self.comm_s += seconds
        end = self._occupy(call.axis, ready, seconds)
        if call.kind == "reduce_scatter":
            self.reduced[call.group] = end
        if call.kind == "all_gather":
            self.gathered[call.group] = end
            if call.axis != "tp":
                self.copy_out[call.group] = packed * call.group_size
        elif self.offload and call.kind == "reduce_scatter":
            self._copy("d2h", end, call.input_bytes // max(call.group_size, 1))  # the output
        if not self.hw.overlap or call.axis == "tp" or call.phase is Phase.OPTIMIZER:
            self._wait_until(end)  # the optimizer's exchange: its step waits for each
        elif self.hw.contention:
            taken = self.hw.contention * seconds  # the cores it moves its bytes on
            self.now += taken
            self.waited_s += taken

    def _fresh_seconds(self, call: CollectiveCall) -> float:
        """Paging in the engine's buffers of ``call`` that come fresh from the OS.

        An all-gather writes the peers' rows into a receive buffer, then the unsharded
        parameters; a reduce-scatter packs the gradients into its input, and its output is
        the new sharded gradient. Each buffer at least ``Hardware.fresh_alloc_bytes`` large is
        paged in at ``fresh_alloc_gbps`` (a host's allocator hands it out anew every step).
        """
        threshold, rate = self.hw.fresh_alloc_bytes, self.hw.fresh_alloc_gbps
        if not threshold or not rate:
            return 0.0
        size = max(call.group_size, 1)
        if call.kind == "all_gather":
            buffers = (call.input_bytes * (size - 1), call.input_bytes * size)
        elif call.kind == "reduce_scatter":
            buffers = (call.input_bytes, call.input_bytes // size)
        else:
            return 0.0
        return sum(b for b in buffers if b >= threshold) / (rate * 1e9)

    def _copy(self, direction: str, ready: float, nbytes: int) -> float:
        assert self.hw.host_link is not None  # only with offload, which needs the link
        seconds = self.hw.host_link.seconds(nbytes)
        self.offload_s += seconds
        end = self._occupy(direction, ready, seconds)
        if not self.hw.overlap:
            self._wait_until(end)
        return end

    def _optimizer(self) -> None:
        # The end-of-backward callback waits for every reduction (and its copy) to land.
        self._wait_until(max(self.busy.values(), default=0.0))
        self.optimizer_start = self.now
        if self.offload:
            self.optimizer_s = _host_seconds(self.costs.optimizer, self.hw)
        else:
            self.optimizer_s = costs_seconds(self.costs.optimizer, self.hw)
        self.now += self.optimizer_s

    def result(self) -> StepTime:
        backward_start = (
            self.optimizer_start if self.backward_start is None else self.backward_start
        )
        return StepTime(
            total_s=self.now,
            compute_s=self.compute_s,
            communication_s=self.comm_s,
            exposed_communication_s=self.waited_s,
            recompute_s=self.recompute_s,
            offload_s=self.offload_s,
            optimizer_s=self.optimizer_s,
            kernels=self.kernels,
            phases={
                "forward": backward_start,
                "backward": self.optimizer_start - backward_start,
                "optimizer": self.optimizer_s,
            },
        )
