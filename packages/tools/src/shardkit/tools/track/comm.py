"""CommTracker: every collective a program runs, with its bytes, time, module and phase.

How it sees them (see [Note: observing torch programs] in docs/notes/004):

- Issue: a kernel registered at the BackendSelect key of every c10d and functional collective
  operator sees each call (whoever makes it: torch's ``fully_shard``, FSDP1, DDP's reducer,
  shardkit, DTensor's redistributions for tensor parallelism, compiled code, user code).
  Nothing else is hooked, so other operators cost nothing.
- Completion: the Work's future, where the backend offers one; otherwise the return of the
  wait on it; for a functional collective, the return of ``wait_tensor`` on its result.
- Exposed time: the time the training thread spends inside ``Work.wait`` (wrapped while
  tracking) or ``wait_tensor``, or in the call itself for a blocking (``async_op=False``)
  collective. Waits made inside C++ (DDP's reducer) are not visible, so DDP's exposed time
  reads as zero.
- shardkit's engine announces each collective on its event stream, so the point-to-point
  messages that carry one on gloo are reported as the one all-gather or reduce-scatter they are,
  with the bytes of those messages as its wire bytes.
- Bytes: the payload (what a bandwidth-optimal algorithm sends) and the wire bytes (what the
  backend's algorithm, or the engine's messages, send); see ``c10d_ops``.
- The group served: shardkit's engine names it; for torch's ``fully_shard`` it is worked out
  from the groups' shard sizes and forward order (``fsdp_serves``) when records are read.
- Axis: the mesh axis each collective's process group serves (``mesh_axes``), worked out when
  records are read, not while the program runs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.tools.records import CollectiveRecord, CommSummary, Phase, RankReport
from shardkit.tools.track import comm_summary
from shardkit.tools.track.c10d_ops import (
    FUNCTIONAL,
    OPERATORS,
    WAIT_TENSOR,
    OpInfo,
    describe,
    outputs,
)
from shardkit.tools.track.comm_minimum import minimum_bytes
from shardkit.tools.track.fsdp_serves import FSDPGroup, attribute, fsdp_groups
from shardkit.tools.track.mesh_axes import axis_of_groups, engine_meshes, meshes_of
from shardkit.tools.track.scope import ModuleScope, ScopeChange
from shardkit.tools.track.tracking import CollectiveOps, MethodWrap, OpCall, Tracker

__all__ = ["CommTracker", "rank_and_world"]


@dataclass(slots=True)
class _Pending:
    """A collective being tracked, until it is finished."""

    info: OpInfo
    op: str
    start_s: float
    module: str
    phase: Phase
    step: int
    issued_s: float = 0.0
    wait_s: float = 0.0
    serves: str | None = None
    wire_bytes: int = 0  # the messages or collectives that carried it, summed
    done_s: list[float] = field(default_factory=list)  # completion of each of its works

    def record(self, axes: dict[str, str]) -> CollectiveRecord:
        end = max([self.issued_s, *self.done_s])
        return CollectiveRecord(
            kind=self.info.kind,
            op=self.op,
            group_size=self.info.group_size,
            group=self.info.group,
            input_bytes=self.info.input_bytes,
            sent_bytes=self.info.sent_bytes,
            wire_bytes=self.wire_bytes,
            start_s=self.start_s,
            end_s=end,
            wait_s=self.wait_s,
            module=self.module,
            phase=self.phase,
            step=self.step,
            serves=self.serves,
            axis=axes.get(self.info.group),
        )


def _timed_wait(original: Any, trackers: list[CommTracker]) -> Any:
    def wait(work: dist.Work, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(work, *args, **kwargs)
        finally:
            ended = time.perf_counter()
            for active in tuple(trackers):
                active._on_wait(work, started, ended)

    return wait


_WAIT_WRAP: MethodWrap[CommTracker] = MethodWrap(dist.Work, "wait", _timed_wait)


_COLLECTIVE_OPS = CollectiveOps(OPERATORS)


class CommTracker(Tracker):
    """Records every collective run inside it, on this rank.

    Use as a context manager around training steps::

        with CommTracker() as comm:
            for batch in data:
                train_step(batch)
        sent = comm.summary().steps[-1].sent_bytes

    Args:
        theoretical_min_bytes: the bytes a rank must send per training step for this model and
            sharding (``shardkit.tools.theory`` or the planner give it); reports then show how
            far each step is from it. None: computed from the model's FSDP groups where it can
            be (``comm_minimum``).
        scope: a started :class:`ModuleScope` to share with other trackers; by default the
            tracker makes and runs its own.
        meshes: DeviceMeshes whose axes to name collectives by, besides those found on the
            DTensor parameters of the modules that ran (needed only for collectives on a mesh
            no such parameter lives on).
    """

    def __init__(
        self,
        *,
        theoretical_min_bytes: int | None = None,
        scope: ModuleScope | None = None,
        meshes: Iterable[DeviceMesh] = (),
    ) -> None:
        self.theoretical_min_bytes = theoretical_min_bytes
        self.meshes = tuple(meshes)
        self._own_scope = scope is None
        self.scope = scope if scope is not None else ModuleScope()
        self._pending: list[_Pending] = []
        self._by_work: dict[int, tuple[_Pending, object]] = {}  # id(work) -> (owner, work)
        self._logical: _Pending | None = None  # a shardkit collective being issued
        self._results = WeakIdKeyDictionary()  # a functional collective's result -> _Pending
        self._running = False
        self._unsubscribe: Any = None
        self._lock = threading.Lock()
        # The FSDP groups as of the last optimizer step, while their process groups are alive
        # (a report written at exit may come after destroy_process_group).
        self._groups: list[FSDPGroup] = []
        self._groups_of = 0  # how many modules the scope knew when _groups was made
        self._axes: dict[str, str] = {}  # process group name -> mesh axis, while alive
        self._axes_asked: set[str] = set()  # the group names _axes was refreshed for
        self.scope.add_listener(self._on_scope_change)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> CommTracker:
        """Start recording (what ``with`` does)."""
        if self._running:
            raise RuntimeError("CommTracker is already running")
        if self._own_scope:
            self.scope.start()
        self._subscribe_to_shardkit()
        _WAIT_WRAP.add(self)
        _COLLECTIVE_OPS.add(self)
        self._running = True
        return self

    def stop(self) -> None:
        """Stop recording; what was recorded stays available."""
        if not self._running:
            return
        self._running = False
        _COLLECTIVE_OPS.remove(self)
        _WAIT_WRAP.remove(self)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._own_scope:
            self.scope.stop()

    # -- results -----------------------------------------------------------------------------

    @property
    def records(self) -> list[CollectiveRecord]:
        """Every collective so far, in issue order."""
        # The axes found at the last step stand for groups destroyed since.
        axes = {**self._axes, **self._mesh_axes()}
        with self._lock:
            records = [p.record(axes) for p in self._pending]
        return attribute(records, self._fsdp_groups(), self.scope.spans, self.scope.forward_ends)

    def _on_scope_change(self, change: ScopeChange) -> None:
        if change.what != "step" or not self._running:
            return
        modules = self.scope.named_modules()
        if len(modules) != self._groups_of:  # new modules ran: their groups may be new too
            self._groups = fsdp_groups(modules)
            self._axes.update(self._mesh_axes())
            self._groups_of = len(modules)

    def _mesh_axes(self) -> dict[str, str]:
        modules = list(self.scope.modules())
        return axis_of_groups([*self.meshes, *engine_meshes(modules), *meshes_of(modules)])

    def _fsdp_groups(self) -> list[FSDPGroup]:
        """The model's FSDP groups now, or as of the last step if their groups are gone."""
        groups = fsdp_groups(self.scope.named_modules())
        if any(g.process_group is None for g in groups) and self._groups:
            return self._groups
        return groups

    def summary(self) -> CommSummary:
        """Totals per training step, against the theoretical minimum when known."""
        return self._summarize(self.records)

    def _summarize(self, records: list[CollectiveRecord]) -> CommSummary:
        summary = comm_summary.summarize(records, self.scope, self.theoretical_min_bytes)
        if self.theoretical_min_bytes is not None or not summary.steps:
            return summary
        # The last step reported is the steady state: lazy initialisation is behind it.
        last = summary.steps[-1].step
        minimum = minimum_bytes([r for r in records if r.step == last], self._fsdp_groups())
        if not minimum:
            return summary
        return dataclasses.replace(summary, theoretical_min_bytes=minimum, minimum_computed=True)

    def rank_report(self) -> RankReport:
        """This rank's records, compute spans and summary, ready for the reports."""
        rank, world = rank_and_world()
        records = self.records  # built once: the summary is made from the same list
        return RankReport(
            rank=rank,
            world_size=world,
            clock_origin_unix_s=self.scope.t0_unix,
            collectives=records,
            spans=list(self.scope.spans),
            comm=self._summarize(records),
        )

    # -- observation -------------------------------------------------------------------------

    def _subscribe_to_shardkit(self) -> None:
        try:
            from shardkit.core import CollectiveEvent, CollectiveIssuedEvent, subscribe
        except ImportError:  # shardkit-core is optional: other engines are seen all the same
            return

        def on_event(event: object) -> None:
            if isinstance(event, CollectiveEvent):
                self._logical = None
                if event.group_size > 1:
                    info = OpInfo(
                        event.kind, event.group_size, "", event.input_bytes, event.sent_bytes
                    )
                    self._logical = self._new(info, f"shardkit.{event.kind}")
                    # The engine names the group it serves ('<root>' is our '').
                    fqn = event.module_fqn
                    self._logical.serves = "" if fqn == "<root>" else fqn or None
            elif isinstance(event, CollectiveIssuedEvent) and self._logical is not None:
                self._logical.issued_s = self.scope.now()
                self._logical = None

        self._unsubscribe = subscribe(on_event)

    def _new(self, info: OpInfo, op: str, started: float | None = None) -> _Pending:
        module, phase = self.scope.current()
        now = self.scope.now() if started is None else started - self.scope.t0
        pending = _Pending(info, op, now, module, phase, self.scope.step, issued_s=now)
        with self._lock:
            self._pending.append(pending)
        return pending

    def on_collective(self, call: OpCall) -> None:
        """Record one collective operator call (see ``CollectiveOps``)."""
        func = call.func
        if func.namespace == FUNCTIONAL:
            self._on_functional(call)
            return
        info = describe(func, call.args, call.kwargs)
        if info is None:
            return
        if self._logical is not None:
            owner = self._logical  # one of the messages that carry a shardkit collective
            if not owner.info.group:
                owner.info = dataclasses.replace(owner.info, group=info.group)
        else:
            owner = self._new(info, f"{func.namespace}.{func._opname}", call.called_s)
        if info.group and info.group not in self._axes_asked:
            # A group seen for the first time: name its axis while it is alive.
            self._axes_asked.add(info.group)
            self._axes.update(self._mesh_axes())
        owner.issued_s = call.returned_s - self.scope.t0
        owner.wire_bytes += info.wire_bytes
        if info.blocking:
            owner.wait_s += call.returned_s - call.called_s
        for work in _works(call.out):
            self._watch(owner, work)

    def _on_functional(self, call: OpCall) -> None:
        # A functional collective returns its result at once; it is complete when
        # wait_tensor on that result returns, and the time spent there is exposed.
        func = call.func
        if func._opname == WAIT_TENSOR:
            pending = self._results.pop(call.args[0], None)
            if pending is not None:
                pending.wait_s += call.returned_s - call.called_s
                pending.done_s.append(call.returned_s - self.scope.t0)
            return
        info = describe(func, call.args, call.kwargs)
        if info is None:
            return
        pending = self._new(info, f"{func.namespace}.{func._opname}", call.called_s)
        pending.issued_s = call.returned_s - self.scope.t0
        pending.wire_bytes = info.wire_bytes
        for result in outputs(call.out):
            self._results[result] = pending

    def _watch(self, owner: _Pending, script_work: torch.ScriptObject) -> None:
        work = dist.Work.unbox(script_work)
        self._by_work[id(work)] = (owner, work)
        try:
            future = work.get_future()
        except RuntimeError:
            return  # no future on this backend's work (gloo send/recv): the wait tells
        future.add_done_callback(lambda _f: self._on_done(work))

    def _on_done(self, work: dist.Work) -> None:
        # Runs on the backend's thread when the work finishes.
        entry = self._by_work.pop(id(work), None)
        if entry is not None:
            entry[0].done_s.append(time.perf_counter() - self.scope.t0)

    def _on_wait(self, work: dist.Work, started: float, ended: float) -> None:
        entry = self._by_work.get(id(work))
        if entry is None:
            return
        owner = entry[0]
        owner.wait_s += ended - started
        if self._by_work.pop(id(work), None) is not None:  # finished, and no future told us
            owner.done_s.append(ended - self.scope.t0)


def _works(out: Any) -> list[torch.ScriptObject]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [item for item in items if isinstance(item, torch.ScriptObject)]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
