"""What a plan reports: frozen, JSON-friendly results of :func:`shardkit.tools.plan`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardkit.tools.records import Category, Phase

__all__ = [
    "Bandwidth",
    "CollectiveCall",
    "CollectivePlan",
    "GroupPlan",
    "MemoryPlan",
    "MemoryPoint",
    "PlannedGroup",
    "StepMark",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedGroup:
    """One FSDP group (one ``fully_shard`` call) and its per-rank buffer sizes."""

    fqn: str
    """The module's FQN; '<root>' for the root."""
    module_class: str
    """The module's class name (``type(module).__name__``)."""
    param_count: int
    """Elements of its parameters (unsharded, unpadded)."""
    trainable_count: int
    """Elements of its trainable parameters."""
    sharded_bytes: int
    """Padded shard bytes per rank: the flat sharded buffer, alignment included."""
    unsharded_bytes: int
    """Bytes of the flat unsharded buffer while the parameters are gathered."""
    gather_input_bytes: int
    """What one rank contributes to the all-gather (the padded shard in the gather dtype)."""
    reduce_output_bytes: int
    """One rank's reduce-scatter output (padded gradient shards in the reduce dtype)."""
    reshard_after_forward: bool
    """Whether this group frees its parameters after forward (the root may keep them)."""


# The old name stays importable: it was public (shardkit.tools.__all__), but it is also the
# name of the engine's own value (shardkit.core.engine.group.plan.GroupPlan).
GroupPlan = PlannedGroup
"""The former name of :class:`PlannedGroup`, kept for old imports."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCall:
    """One collective of a training step, in the order the engine issues them."""

    kind: str
    """'all_gather', 'reduce_scatter' or 'all_reduce' (HSDP, or tensor parallelism)."""
    group: str
    """FQN of the FSDP group it serves; on the tp axis, of the module whose ParallelStyle
    converts the tensor (of the parameter, for a partial gradient's all-reduce)."""
    axis: str
    """The mesh axis it runs on, by torchtitan's names: 'dp' (FSDP), 'dp_shard' and
    'dp_replicate' (HSDP), 'tp'."""
    group_size: int
    """Ranks in the process group."""
    input_bytes: int
    """What this rank contributes (as ``shardkit.core.CollectiveEvent.input_bytes``, or
    the functional collective's input on tp)."""
    sent_bytes: int
    """What this rank sends under a bandwidth-optimal algorithm."""
    phase: Phase
    """Forward or backward."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectivePlan:
    """The calls of one kind, size and axis for one group in a step."""

    kind: str
    """'all_gather', 'reduce_scatter' or 'all_reduce'."""
    group: str
    """FQN of the FSDP group, or of the styled module on tp (see ``CollectiveCall``)."""
    axis: str
    """The mesh axis (see ``CollectiveCall.axis``)."""
    group_size: int
    """Ranks in the process group."""
    input_bytes: int
    """Bytes this rank contributes per call."""
    sent_bytes: int
    """Bytes this rank sends per call."""
    calls: int
    """Calls per training step."""

    @property
    def sent_bytes_per_step(self) -> int:
        """Bytes this rank sends for these calls in one step."""
        return self.sent_bytes * self.calls


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPoint:
    """Live bytes by category at one moment of the simulated step."""

    label: str
    """What just happened, e.g. 'all-gather blocks.3 (prefetch)'."""
    module: str
    """The group whose event or compute it is ('' outside any)."""
    phase: Phase
    """Forward, backward or optimizer."""
    by_category: dict[Category, int]
    """Bytes per category (every category present), in the device's memory."""
    host_by_category: dict[Category, int] = field(default_factory=dict)
    """Bytes per category in host memory (CPU offload: sharded parameters, their gradients,
    optimizer state); empty without offload. Not in ``total``."""
    allocated: int = 0
    """What torch's CUDA caching allocator would count as allocated at this moment: the
    device's buffers as its blocks, each rounded up, some whole blocks larger than asked
    (``caching_allocator``). Not in ``total``, which is the live tensor bytes."""
    reserved: int = 0
    """The allocator's segments at this moment (``reserved_bytes``): what the GPU holds."""

    @property
    def total(self) -> int:
        """All live bytes on the device."""
        return sum(self.by_category.values())

    @property
    def host_total(self) -> int:
        """All live bytes in host memory."""
        return sum(self.host_by_category.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """Per-rank memory over one steady-state training step."""

    peak: MemoryPoint
    """The moment of the highest total, with its breakdown."""
    category_max: dict[Category, int]
    """The highest value each category reaches (at different moments)."""
    timeline: tuple[MemoryPoint, ...]
    """Every allocation of the step, in order."""
    allocated_peak: int = 0
    """The most the CUDA caching allocator would count as allocated (block sizes) over the
    step, the planner's buffers replayed through it (``caching_allocator``); 0: not replayed.
    What ``torch.cuda.max_memory_allocated`` measures, where ``peak.total`` is live bytes."""
    reserved_peak: int = 0
    """The most it would reserve (segments, never given back): what must fit on a GPU, and
    what ``shardkit-plan --fit`` budgets on CUDA (``torch.cuda.max_memory_reserved``)."""

    @property
    def host_peak(self) -> int:
        """The most host memory the step holds (CPU offload; 0 without)."""
        return max((p.host_total for p in self.timeline), default=0)

    @property
    def combined_peak(self) -> MemoryPoint:
        """The moment of the most device and host bytes together (one memory on a CPU)."""
        return max(self.timeline, key=lambda p: p.total + p.host_total)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMark:
    """One point of a step, in program order, for the step-time replay (``step_time``)."""

    kind: str
    """'compute' (a segment's forward or backward runs), 'collective' (one is issued),
    'wait' (compute needs a group's all-gather to have landed) or 'optimizer' (the step ends:
    every collective is waited for, then the optimizer runs)."""
    phase: Phase
    """Forward, backward or optimizer."""
    index: int = 0
    """The segment (compute) or the position in the plan's schedule (collective)."""
    group: str = ""
    """The group's FQN (wait)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bandwidth:
    """The bandwidth a plan's communication time uses, and where it came from."""

    gbps: float | None
    """GB/s (1e9 bytes per second) one rank sends at; None: no time can be given."""
    source: str
    """'given', 'default', 'measured', 'cached' or 'unavailable'."""
    detail: str
    """For people: how it was obtained, or why there is none."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"gbps": self.gbps, "source": self.source, "detail": self.detail}
