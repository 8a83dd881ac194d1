"""Weights to a tensor-parallel engine: each engine rank gets its slice, and only that.

:class:`SlicedExporter` (every rank of the model's mesh) exports to an engine of degree K
colocated with the trainer, as verl's hybrid engine runs: every training process holds one
engine rank, rank ``i`` of the mesh's ranks engine rank ``i % K`` (W / K engines where the
trainer has W ranks). Per bucket of whole layers (``buckets.py``):

1. every trainer rank sends every receiving rank the overlap of its shard with that rank's
   window (``tp_routes.py``, windows from ``tp_slices.py``), cast to the export dtype on the
   sender, as point-to-point messages straight into the window where it is contiguous there;
   its own overlap it copies (``tp_moves.py``). No rank gathers a whole tensor;
2. each rank hands its windows to its receiver (:class:`SliceReceiver`; vLLM's in
   ``vllm_slices.py``, or, for an engine whose K workers run in processes of their own, in
   ``vllm_slices_remote.py``: trainer rank ``r`` sends them on to worker ``r``).

After the last bucket the receiver's ``commit``, where it has one, before the ranks' last
agreement: a receiver elsewhere that could not take it all fails every rank.

Around the buckets, as :class:`~shardkit.core.export.WeightExporter`: the ranks agree on the
plan first, on their receivers' ``begin`` next (a refusal stops every rank before any bucket
moves), and on the outcome last, every wait is bounded (``SHARDKIT_EXPORT_BOUND``), and a
failure anywhere (a receiver that raised, a rank late past the bound) is one
:class:`~shardkit.core.errors.WeightExportError` on every rank. Full exports only.

Memory: a rank holds its windows of one bucket (1/K of the bucket's cut tensors, its whole
tensors) and the overlaps it sends (its shard of the bucket, cast).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.core.errors import WeightExportError
from shardkit.core.export.axis_gathers import TensorSource, mesh_of
from shardkit.core.export.buckets import (
    ExportBucket,
    default_layer_of,
    export_sources,
    plan_buckets,
    plan_digest,
)
from shardkit.core.export.messages import ExportedTensor, ExportManifest
from shardkit.core.export.receiver_guard import guard_receiver, receiver_outcome
from shardkit.core.export.tp_moves import PlannedTensor, cut_bucket, exchange
from shardkit.core.export.tp_routes import blocks_by_rank, plan_routes
from shardkit.core.export.tp_slices import EngineTP, Window
from shardkit.core.runtime.export.export_groups import (
    ExportGroups,
    ExportWatch,
    all_gather_vector,
    export_bound_s,
    make_export_groups,
)
from shardkit.core.runtime.groups import global_rank, is_distributed

__all__ = ["SliceReceiver", "SlicedBucket", "SlicedExporter", "SlicedReport"]

_EXPORTERS = itertools.count(1_000_000)  # apart from WeightExporter's numbers in the store


@dataclass(frozen=True, slots=True)
class SlicedBucket:
    """One bucket as one engine rank receives it: its window of each tensor."""

    index: int
    engine_rank: int
    """The engine rank these windows are for (-1: none, a rank that only sends)."""
    degree: int
    """The engine's tensor-parallel degree."""
    windows: tuple[tuple[Window, torch.Tensor], ...]
    """Each tensor's window and its elements (``window.local_shape``, the export dtype)."""


class SliceReceiver(Protocol):
    """Takes one sliced export: a manifest (full shapes), its buckets in order, the outcome."""

    def begin(self, manifest: ExportManifest) -> None:
        """Check the manifest before anything is written; raise to refuse the export."""

    def receive(self, bucket: SlicedBucket) -> None:
        """Load one bucket's windows."""

    def finish(self) -> None:
        """Every trainer rank agreed the export went through.

        A receiver may also have ``commit()``, called after the last bucket and before that
        agreement (``vllm_slices_remote.py``'s: every worker loaded it all).
        """

    def abort(self, error: BaseException) -> None:
        """The export failed (``error`` is what every trainer rank raises)."""


@dataclass(slots=True)
class SlicedReport:
    """What one sliced export did on this rank."""

    export_id: int
    engine_rank: int | None
    """None: this rank only sends (an engine elsewhere fed by the mesh's first K ranks)."""
    window_bytes: int = 0
    """The bytes of this rank's windows: what its engine rank holds of the model."""
    received_bytes: int = 0
    """Of those, received from other ranks."""
    copied_bytes: int = 0
    """Of those, copied from this rank's own shards."""
    sent_bytes: int = 0
    """Sent to other ranks (its shards' overlaps with their windows)."""
    messages: int = 0
    """Point-to-point messages this rank sent and received."""
    seconds: float = 0.0
    handoff_seconds: float = 0.0
    """Of that, in the receiver."""


@dataclass(slots=True)
class _Run:
    """One export in flight on this rank."""

    export_id: int
    groups: ExportGroups | None
    watch: ExportWatch | None
    report: SlicedReport


class SlicedExporter:
    """Exports a sharded model's weights to colocated engine ranks of TP degree ``engine.degree``.

    Args:
        model: the model (the root of its ``fully_shard`` calls), on every rank of its mesh.
        engine: the engine's degree and head counts (:meth:`EngineTP.from_config`).
        dtype: the engine's dtype (floating tensors cast on the sender); None: as stored.
        bucket_bytes: a bucket's bound in the export dtype (whole layers; a larger layer alone).
        min_buckets: buckets are also at most the export's bytes over this
            (``ExportOptions.min_buckets``).
        layer_of: a name's layer (its tensors arrive in one bucket).
        rename: the engine's name for a tensor (None leaves it out).
        bound_s: how late a rank may be before every rank raises (``SHARDKIT_EXPORT_BOUND``).
        one_engine: only the mesh's first K ranks receive, engine ranks 0..K-1 of one engine
            (whose workers run elsewhere, ``vllm_slices_remote.py``); the others only send.
            False: every rank receives, rank ``i`` engine rank ``i % K`` (W / K engines).

    Raises:
        ValueError: the mesh's ranks are not a multiple of the degree; a tensor with no rule or
            a size the engine cannot split; a placement that is not one block per rank.
    """

    def __init__(
        self,
        model: nn.Module,
        engine: EngineTP,
        *,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 64 * 2**20,
        min_buckets: int = 4,
        layer_of: Callable[[str], str] = default_layer_of,
        rename: Callable[[str], str | None] | None = None,
        bound_s: float | None = None,
        one_engine: bool = False,
    ) -> None:
        self.engine = engine
        self.bound_s = export_bound_s(bound_s)
        self._index = next(_EXPORTERS)
        self._next_id = 0
        self._groups: ExportGroups | None = None
        meshes = [m for v in model.state_dict(keep_vars=True).values() if (m := mesh_of(v))]
        self.mesh = max(meshes, key=lambda m: m.ndim) if meshes else None
        ranks = sorted(int(r) for r in self.mesh.mesh.flatten()) if self.mesh is not None else [0]
        if len(ranks) % engine.degree:
            raise ValueError(
                f"a colocated engine of TP degree {engine.degree} needs a multiple of "
                f"{engine.degree} trainer ranks; the model's mesh has {len(ranks)}"
            )
        self.world_ranks = ranks
        receiving = ranks[: engine.degree] if one_engine else ranks
        self.engine_ranks = {g: i % engine.degree for i, g in enumerate(receiving)}
        """Receiving global rank -> the engine rank whose windows it takes."""
        sources = export_sources(
            model, dtype=dtype, keep_dims=set(), rename=rename, include_tied=False, root=self.mesh
        )
        self.buckets = plan_buckets(sources, bucket_bytes, layer_of, min_buckets)
        self.digest = plan_digest(self.buckets) ^ engine.degree ^ (one_engine << 16)
        self._planned = {b.index: [self._plan(s) for s in b.sources] for b in self.buckets}

    def _plan(self, source: TensorSource) -> PlannedTensor:
        value = source.tensor.detach()
        blocks = None
        if isinstance(value, DTensor) and self.mesh is not None:
            blocks = blocks_by_rank(source.key, value, self.mesh)
        shape = tuple(value.shape)
        windows, routes = plan_routes(self.engine, source.name, shape, blocks, self.engine_ranks)
        me = global_rank() if is_distributed() else 0
        block = blocks.get(me) if blocks is not None else tuple((0, s) for s in shape)
        return PlannedTensor(source.key, source.name, source.dtype, windows, routes, block)

    @property
    def engine_rank(self) -> int | None:
        """The engine rank whose windows this process takes (None: it only sends)."""
        return self.engine_ranks.get(global_rank() if is_distributed() else 0)

    def manifest(self, export_id: int) -> ExportManifest:
        """The export's tensors, with their full shapes (the receiver holds windows of them)."""
        entries = tuple(
            ExportedTensor(s.name, tuple(s.tensor.shape), s.dtype, b.index)
            for b in self.buckets
            for s in b.sources
        )
        return ExportManifest(export_id, "full", entries, len(self.buckets))

    def export(self, receiver: SliceReceiver | None) -> SlicedReport:
        """Export now; every rank of the mesh calls it, each with its engine rank's receiver.

        A rank that only sends (``one_engine``, past the first K) passes None.

        Raises:
            ValueError: a receiving rank passed no receiver (before anything is sent).
            WeightExportError: on every rank, with the same message (a rank late past the
                bound, a receiver that failed, ranks that disagree on the plan).
        """
        if receiver is None and self.engine_rank is not None:
            raise ValueError(f"engine rank {self.engine_rank}'s trainer rank needs a receiver")
        export_id, self._next_id = self._next_id, self._next_id + 1
        run = self._open(export_id)
        start = time.perf_counter()
        try:
            try:
                self._steps(run, receiver or _SENDS_ONLY)
            except WeightExportError:
                raise
            except Exception as error:
                if run.watch is None:
                    raise
                raise run.watch.give_verdict(
                    f"weight export {export_id} (TP-sliced): rank {global_rank()} failed in "
                    f"{run.watch.where}: {type(error).__name__}: {error}"
                ) from error
        except BaseException as error:
            if self._groups is not None:
                self._groups.dead = True  # a peer may have left messages pending on them
            (receiver or _SENDS_ONLY).abort(error)
            raise
        run.report.seconds = time.perf_counter() - start
        return run.report

    def _open(self, export_id: int) -> _Run:
        report = SlicedReport(export_id, self.engine_rank)
        if self.mesh is None or not is_distributed():
            return _Run(export_id, None, None, report)
        if self._groups is None or self._groups.dead:
            self._groups = make_export_groups(self.mesh, [], self.bound_s)
        watch = ExportWatch.open(self._index, export_id, global_rank(), self.bound_s)
        return _Run(export_id, self._groups, watch, report)

    def _steps(self, run: _Run, receiver: SliceReceiver) -> None:
        head = torch.tensor([self.digest, run.export_id], dtype=torch.int64)
        rows = self._all_gather(run, head, "agreement")
        if rows is not None and not bool((rows == rows[0]).all()):
            assert run.watch is not None
            raise run.watch.give_verdict(
                f"weight export {run.export_id} (TP-sliced): the ranks do not export the same "
                "plan (the same model, options and engine degree, as many exports)"
            )
        self._begin(run, receiver, self.manifest(run.export_id))
        for bucket in self.buckets:
            ready = self._move(run, bucket)
            self._guarded(run, partial(receiver.receive, ready), f"bucket {bucket.index}")
            del ready  # one bucket's windows held at a time
        commit = getattr(receiver, "commit", None)
        if commit is not None:
            # Before the ranks' last agreement: a receiver elsewhere that fails to take it
            # all (vllm_slices_remote.py) fails every rank.
            self._guarded(run, commit, "commit")
        self._all_gather(run, torch.zeros(1, dtype=torch.int64), "end")
        self._guarded(run, receiver.finish, "finish")

    def _begin(self, run: _Run, receiver: SliceReceiver, manifest: ExportManifest) -> None:
        """The receivers' ``begin``, then an agreement every rank joins, refused or not.

        A rank whose receiver refused (a driver that found the engine amiss) joins it too,
        and only then gives its verdict: no rank goes on to post messages to a peer that has
        stopped (a rank that had, in a TP-sliced export into vLLM, died of SIGABRT one bound
        later, its messages still pending).
        """
        seconds, failure = receiver_outcome(
            run.watch, lambda: receiver.begin(manifest), "begin", **self._names(run)
        )
        run.report.handoff_seconds += seconds
        flags = torch.tensor([failure is not None], dtype=torch.int64)
        refused = self._all_gather(run, flags, "agreement after begin")
        if run.watch is None or refused is None:
            return
        if failure is not None:
            raise run.watch.give_verdict(failure[0]) from failure[1]
        if bool(refused.any()):  # a peer refused: its verdict comes right after the gather
            deadline = time.monotonic() + run.watch.bound_s
            while (verdict := run.watch.verdict()) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            what = verdict or f"weight export {run.export_id} (TP-sliced): a receiver refused it"
            raise run.watch.give_verdict(what)

    def _all_gather(self, run: _Run, vector: torch.Tensor, what: str) -> torch.Tensor | None:
        if run.groups is None or run.watch is None:
            return None
        run.watch.post(f"the export's {what}")
        run.watch.raise_if_failed()
        works, rows = all_gather_vector(vector, run.groups)
        run.watch.wait(works, run.groups.world_ranks, on_device=rows.device.type != "cpu")
        return rows.cpu()

    def _move(self, run: _Run, bucket: ExportBucket) -> SlicedBucket:
        """This rank's windows of ``bucket``: its own overlaps copied, the others received."""
        me = global_rank() if is_distributed() else 0
        move = cut_bucket(self._planned[bucket.index], bucket.sources, me, self._peer)
        report = run.report
        report.window_bytes += move.window_bytes
        report.copied_bytes += move.copied_bytes
        report.sent_bytes += sum(
            t.numel() * t.element_size() for ts in move.sends.values() for t in ts
        )
        report.received_bytes += sum(
            t.numel() * t.element_size() for ts in move.receives.values() for t in ts
        )
        report.messages += sum(len(ts) for ts in (*move.sends.values(), *move.receives.values()))
        label = f"bucket {bucket.index} ({bucket.sources[0].name}, ...): slices"
        exchange(move, run.groups, run.watch, label)
        engine_rank = self.engine_ranks.get(me, -1)
        return SlicedBucket(bucket.index, engine_rank, self.engine.degree, tuple(move.windows))

    def _peer(self, rank: int) -> int:
        """A global rank's rank in the export's world group."""
        return self.world_ranks.index(rank)

    def _guarded(self, run: _Run, work: Callable[[], None], label: str) -> None:
        """Receiver work, timed; its failure or lateness becomes every rank's verdict."""
        run.report.handoff_seconds += guard_receiver(run.watch, work, label, **self._names(run))

    @staticmethod
    def _names(run: _Run) -> dict[str, str]:
        """The export and the receiver, as a failure's message names them."""
        return {
            "export": f"weight export {run.export_id} (TP-sliced)",
            "receiver": f"the receiver of engine rank {run.report.engine_rank}",
        }


class _SendsOnly:
    """The receiver of a rank that takes no windows (``one_engine``, past the first K)."""

    def begin(self, manifest: ExportManifest) -> None:
        """Nothing to check."""

    def receive(self, bucket: SlicedBucket) -> None:
        """Nothing arrives."""

    def finish(self) -> None:
        """Nothing to finish."""

    def abort(self, error: BaseException) -> None:
        """Nothing to undo."""


_SENDS_ONLY = _SendsOnly()
