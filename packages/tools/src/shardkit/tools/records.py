"""What the trackers record: plain, frozen, JSON-friendly data shared by trackers and reports.

Times are seconds since the tracker started (``time.perf_counter`` based); bytes are ints.
Every record converts to and from a plain dict (``to_dict`` / ``from_dict``) so one rank's
results can be written as JSON and merged with the other ranks' by ``shardkit-profile``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "AxisComm",
    "Category",
    "CollectiveRecord",
    "CommSummary",
    "MemoryReport",
    "MemorySample",
    "ModulePeak",
    "Phase",
    "PhaseSpan",
    "RankReport",
    "StepComm",
    "aligned",
]


class Phase(str, enum.Enum):  # noqa: UP042 (StrEnum needs Python 3.11; we support 3.10)
    """Which part of a training step a program was in."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


class Category(str, enum.Enum):  # noqa: UP042 (as Phase)
    """What a byte of tensor memory is for, from most to least specific."""

    SHARDED_PARAMS = "sharded_params"
    UNSHARDED_PARAMS = "unsharded_params"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    COMM_BUFFERS = "comm_buffers"
    OTHER = "other"


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveRecord:
    """One collective (or point-to-point message) as this rank saw it."""

    kind: str
    """'all_gather', 'reduce_scatter', 'all_reduce', 'broadcast', 'all_to_all', 'send', ..."""
    op: str
    """What was called: a c10d op such as 'c10d._allgather_base_', or 'shardkit.all_gather'."""
    group_size: int
    """Ranks in the process group."""
    group: str
    """The process group's name (c10d's, e.g. '0' for the default group)."""
    input_bytes: int
    """Bytes this rank contributes."""
    sent_bytes: int
    """Bytes this rank must send under a bandwidth-optimal algorithm (the payload)."""
    start_s: float
    """When it was issued."""
    end_s: float
    """When it completed (its work finished), as seen from this rank."""
    wait_s: float
    """How long this rank's training thread was blocked waiting for it (exposed time)."""
    module: str
    """Fully qualified name of the innermost module running when issued ('' for none)."""
    phase: Phase
    step: int
    """The optimizer steps completed before it was issued."""
    serves: str | None = None
    """The module (FQN, '' for the root) whose parameters it gathers or whose gradients it
    reduces, where the engine says (shardkit's does); None when unknown. A prefetch serves
    another module than the one running."""
    axis: str | None = None
    """The DeviceMesh axis its process group serves, by the mesh's dim name ('dp', 'tp',
    'dp_shard', ...); None when no known mesh with dim names has that group."""
    wire_bytes: int | None = None
    """Bytes this rank put on the wire for it under the algorithm that ran: gloo's own
    collectives' (its reduce-scatter sends twice the payload), or the point-to-point messages
    an engine carried it in; None when not recorded (reports of older versions)."""

    @property
    def duration_s(self) -> float:
        """Issue to completion."""
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseSpan:
    """A stretch of time one module spent in one phase (the compute timeline)."""

    module: str
    phase: Phase
    start_s: float
    end_s: float
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisComm:
    """The part of one training step's communication on one mesh axis."""

    axis: str | None
    """The mesh axis (see ``CollectiveRecord.axis``); None for groups of no known axis."""
    collectives: int
    sent_bytes: int
    comm_s: float
    """Wall time during which at least one of its collectives was in flight."""
    exposed_s: float
    """Time the training thread was blocked on its collectives."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepComm:
    """Communication totals of one training step on one rank."""

    step: int
    collectives: int
    sent_bytes: int
    comm_s: float
    """Wall time during which at least one collective was in flight."""
    exposed_s: float
    """Time the training thread was blocked on collectives."""
    step_s: float
    """Wall time of the step (from its first recorded event to its last)."""
    sent_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    by_axis: list[AxisComm] = field(default_factory=list)
    wire_bytes: int | None = None
    """Bytes on the wire under the algorithms that ran (``CollectiveRecord.wire_bytes``);
    None when a record of the step does not say."""
    """The same step per mesh axis, named axes first (alphabetically), then None."""

    @property
    def overlapped_s(self) -> float:
        """Time collectives were in flight while the rank did other work."""
        return max(0.0, self.comm_s - self.exposed_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommSummary:
    """Per-step totals and how far they are from the theoretical minimum."""

    steps: list[StepComm]
    theoretical_min_bytes: int | None
    """Bytes a rank must send per step for the tracked model, when the tracker knows it."""
    minimum_computed: bool = False
    """Whether the tracker computed that minimum from the model's FSDP groups (see
    ``track.comm_minimum``) rather than being given it."""

    @property
    def sent_over_min(self) -> float | None:
        """Mean bytes sent per full step over the minimum (1.0 is optimal)."""
        if not self.theoretical_min_bytes or not self.steps:
            return None
        mean = sum(s.sent_bytes for s in self.steps) / len(self.steps)
        return mean / self.theoretical_min_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySample:
    """Live tensor bytes by category at one moment."""

    t_s: float
    by_category: dict[Category, int]
    module: str
    phase: Phase
    step: int

    @property
    def total(self) -> int:
        """Bytes over all categories."""
        return sum(self.by_category.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class ModulePeak:
    """The highest live memory seen while one module ran in one phase."""

    module: str
    phase: Phase
    peak: MemorySample


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryReport:
    """One rank's memory: the timeline, the peak, and the peak per module and phase."""

    device: str
    timeline: list[MemorySample]
    """Samples in time order (thinned to a bounded number on long runs)."""
    peak: MemorySample
    module_peaks: list[ModulePeak]
    allocator: dict[str, int] = field(default_factory=dict)
    """On CUDA: the caching allocator's own figures (peak allocated and reserved bytes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankReport:
    """Everything one rank recorded; what ``shardkit-profile`` writes and merges."""

    rank: int
    world_size: int
    collectives: list[CollectiveRecord] = field(default_factory=list)
    spans: list[PhaseSpan] = field(default_factory=list)
    comm: CommSummary | None = None
    memory: MemoryReport | None = None
    clock_origin_unix_s: float = 0.0
    """The wall-clock time (``time.time()``) its times count from; 0.0 when unknown. Ranks
    start their trackers at different moments: this lines them up (see ``aligned``)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums become their values)."""
        plain: dict[str, Any] = _plain(dataclasses.asdict(self))
        return plain

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankReport:
        """The inverse of :meth:`to_dict`; raises ValueError naming a missing key."""
        try:
            comm = data.get("comm")
            memory = data.get("memory")
            return cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                collectives=[_build(CollectiveRecord, r) for r in data.get("collectives", [])],
                spans=[_build(PhaseSpan, s) for s in data.get("spans", [])],
                comm=None if comm is None else _comm_from_dict(comm),
                memory=None if memory is None else _memory_from_dict(memory),
                clock_origin_unix_s=float(data.get("clock_origin_unix_s", 0.0)),
            )
        except KeyError as err:
            raise ValueError(f"rank report is missing the key {err}") from err


def aligned(reports: Sequence[RankReport]) -> list[RankReport]:
    """The reports with every time counted from the earliest rank's origin.

    Reports without a known origin are left as they are.
    """
    origins = [r.clock_origin_unix_s for r in reports if r.clock_origin_unix_s]
    if not origins:
        return list(reports)
    first = min(origins)
    return [
        _shifted(r, r.clock_origin_unix_s - first) if r.clock_origin_unix_s else r for r in reports
    ]


def _shifted(report: RankReport, by: float) -> RankReport:
    def sample(s: MemorySample) -> MemorySample:
        return dataclasses.replace(s, t_s=s.t_s + by)

    memory = report.memory
    if memory is not None:
        memory = dataclasses.replace(
            memory,
            timeline=[sample(s) for s in memory.timeline],
            peak=sample(memory.peak),
            module_peaks=[dataclasses.replace(p, peak=sample(p.peak)) for p in memory.module_peaks],
        )
    return dataclasses.replace(
        report,
        collectives=[
            dataclasses.replace(c, start_s=c.start_s + by, end_s=c.end_s + by)
            for c in report.collectives
        ],
        spans=[
            dataclasses.replace(s, start_s=s.start_s + by, end_s=s.end_s + by) for s in report.spans
        ],
        memory=memory,
        clock_origin_unix_s=report.clock_origin_unix_s - by,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


T = TypeVar("T")


def _build(cls: type[T], data: dict[str, Any]) -> T:
    kwargs = dict(data)
    if "phase" in kwargs:
        kwargs["phase"] = Phase(kwargs["phase"])
    return cls(**kwargs)


def _sample(data: dict[str, Any]) -> MemorySample:
    by_category = {Category(k): int(v) for k, v in data["by_category"].items()}
    return MemorySample(
        t_s=float(data["t_s"]),
        by_category=by_category,
        module=data["module"],
        phase=Phase(data["phase"]),
        step=int(data["step"]),
    )


def _step_from_dict(data: dict[str, Any]) -> StepComm:
    by_axis = [AxisComm(**a) for a in data.get("by_axis", [])]
    return StepComm(**{**data, "by_axis": by_axis})


def _comm_from_dict(data: dict[str, Any]) -> CommSummary:
    return CommSummary(
        steps=[_step_from_dict(s) for s in data["steps"]],
        theoretical_min_bytes=data.get("theoretical_min_bytes"),
        minimum_computed=bool(data.get("minimum_computed", False)),
    )


def _memory_from_dict(data: dict[str, Any]) -> MemoryReport:
    return MemoryReport(
        device=data["device"],
        timeline=[_sample(s) for s in data["timeline"]],
        peak=_sample(data["peak"]),
        module_peaks=[
            ModulePeak(module=p["module"], phase=Phase(p["phase"]), peak=_sample(p["peak"]))
            for p in data["module_peaks"]
        ],
        allocator={k: int(v) for k, v in data.get("allocator", {}).items()},
    )
