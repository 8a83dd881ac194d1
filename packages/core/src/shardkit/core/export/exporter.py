"""The weight exporter: a sharded model's weights, bucket by bucket, to a receiver.

Every rank of the model's mesh calls :meth:`WeightExporter.export` at the same point (after an
optimizer step). Per export:

1. One small all-gather over the mesh's ranks (the export's own group): every rank's plan
   digest, export number and kind, and under ``delta`` its count of changed elements per
   bucket. Ranks that disagree all raise the same error before any bucket moves.
2. Per bucket, per gathered mesh axis (one for FSDP and HSDP; two for FSDP x TP to a receiver
   without TP), one collective: each rank casts its shards to the export dtype while packing
   them (the cast happens on the shard, before the wire) and the receiving rank gets the
   bucket whole: a gather where one rank receives, an all-gather where all do. A bucket whose
   ranks changed nothing moves nothing.
3. The receiving rank hands the bucket to its receiver, then the next bucket starts. A failure
   anywhere gives the export a verdict that every rank raises (``runtime/export/export_groups.py``).
   After the last bucket, the receiver's ``commit`` (where it has one): it switches to this
   export, all at once, or raises still serving the last (``versions.py``); its error too is
   the verdict of every rank.
4. A last small all-gather: every rank got through; the receiver's ``finish``.

The export number is the version it installs (``ExportReport.version``, the receivers'
``version``).

Memory: a non-receiving rank holds one packed part (1/W of a bucket); the receiving rank the
gathered bucket and the unpacked tensors, two buckets. With ``delta``, each rank keeps its
part of the last export (1/W of the model in the export dtype), except a receiving rank whose
receiver holds the last export whole in this process (``ModuleReceiver``, a
``FullTensorReceiver``'s mirror): its rows of that copy are the base there, and nothing is
kept (``delta_find.HeldRows``).
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import torch
from torch import nn

from shardkit.core.errors import WeightExportError
from shardkit.core.export.axis_gathers import export_order, mesh_of
from shardkit.core.export.buckets import export_sources, plan_buckets, plan_digest
from shardkit.core.export.delta_pace import all_paced, settle, start_runs
from shardkit.core.export.delta_transfer import count_changes, move_bucket
from shardkit.core.export.export_options import ExportOptions, ExportReport
from shardkit.core.export.messages import ExportedTensor, ExportKind, ExportManifest
from shardkit.core.export.receivers import WeightReceiver, holds_export
from shardkit.core.export.transfer import BucketTransfer, PreviousExport
from shardkit.core.runtime.export.export_groups import (
    ExportGroups,
    ExportWatch,
    all_gather_vector,
    export_bound_s,
    make_export_groups,
)
from shardkit.core.runtime.groups import global_rank, is_distributed

__all__ = ["ExportOptions", "ExportReport", "WeightExporter", "export_weights"]

_EXPORTERS = itertools.count()


class WeightExporter:
    """Exports a sharded model's weights (torch's or shardkit's ``fully_shard``) to receivers.

    Args:
        model: the model (the root of its ``fully_shard`` calls), on every rank of its mesh.
        options: :class:`ExportOptions` (keyword arguments are taken as options too).

    Raises:
        ValueError: options that do not fit the model (an unknown axis, tensors on different
            meshes, names that collide).
    """

    def __init__(self, model: nn.Module, options: ExportOptions | None = None) -> None:
        self.model = model
        self.options = options or ExportOptions()
        self.bound_s = export_bound_s(self.options.bound_s)
        self._index = next(_EXPORTERS)
        self._next_id = self.options.first_version
        self._previous: PreviousExport | None = None
        self._groups: ExportGroups | None = None
        self._plan()

    def _plan(self) -> None:
        """The sources, their gather order, the buckets and who receives."""
        meshes = [m for v in self.model.state_dict(keep_vars=True).values() if (m := mesh_of(v))]
        # The widest mesh is the root; the others must be named sub-meshes of it.
        self.mesh = max(meshes, key=lambda m: m.ndim) if meshes else None
        keep = self._keep_dims()
        sources = export_sources(
            self.model,
            dtype=self.options.dtype,
            keep_dims=keep,
            rename=self.options.rename,
            include_tied=self.options.include_tied,
            root=self.mesh,
        )
        self.keep_dims = keep
        self.order = export_order([s.tensor for s in sources], keep, self.mesh)
        options = self.options
        self.buckets = plan_buckets(
            sources, options.bucket_bytes, options.layer_of, options.min_buckets
        )
        self.digest = plan_digest(self.buckets)
        coord = self.mesh.get_coordinate() if self.mesh is not None else None
        self.receiving = (
            self.options.to == "all"
            or coord is None
            or all(c == 0 for m, c in enumerate(coord) if m not in keep)
        )

    def _refresh(self) -> None:
        """Re-plan if the model's tensors were replaced since the plan was made.

        A lazy initialisation may swap parameters, and so may ``load_state_dict(assign=True)``:
        an export never reads a stale tensor. The next export is then full, on new groups.
        """
        current = self.model.state_dict(keep_vars=True)
        if all(current.get(s.key) is s.tensor for b in self.buckets for s in b.sources):
            return
        self._plan()
        self._previous = None
        if self._groups is not None:
            self._groups.dead = True

    def _keep_dims(self) -> set[int]:
        if not self.options.keep_axes:
            return set()
        names = self.mesh.mesh_dim_names if self.mesh is not None else None
        unknown = [a for a in self.options.keep_axes if not names or a not in names]
        if unknown:
            raise ValueError(f"keep_axes {unknown} are not axes of the model's mesh ({names})")
        assert names is not None
        return {names.index(a) for a in self.options.keep_axes}

    def manifest(self, kind: ExportKind, export_id: int) -> ExportManifest:
        """What export ``export_id`` sends, as the receiver is told first."""
        entries = tuple(
            ExportedTensor(s.name, s.shape, s.dtype, b.index)
            for b in self.buckets
            for s in b.sources
        )
        return ExportManifest(export_id, kind, entries, len(self.buckets))

    def reset(self) -> None:
        """Forget the last export: the next is full (call on every rank, as ``export``)."""
        self._previous = None

    def export(
        self, receiver: WeightReceiver | None = None, *, delta: bool = False
    ) -> ExportReport:
        """Export the weights now; every rank of the mesh calls it.

        Args:
            receiver: where the buckets go, on the receiving ranks (:attr:`receiving`);
                ignored elsewhere.
            delta: send only the elements changed since the last export (the first export,
                and the one after a failure or :meth:`reset`, is full).

        Raises:
            WeightExportError: on every rank, with the same message: a rank late past the
                bound, a receiver that failed (chained on its rank), ranks that disagree.
            ValueError: ``receiver`` missing on a receiving rank.
        """
        if self.receiving and receiver is None:
            raise ValueError("this rank receives the export: pass a receiver")
        self._refresh()
        kind: ExportKind = "delta" if delta and self._previous is not None else "full"
        if delta:
            self._check_delta()
        export_id, self._next_id = self._next_id, self._next_id + 1
        start = time.perf_counter()
        transfer = self._transfer(export_id, kind, track=delta)
        if delta and self.receiving and holds_export(receiver):
            # Its copy is the next delta's base on this rank: no part kept (1/W of the model).
            transfer.keep_parts = False
            transfer.kept.receiver = receiver
        try:
            handoff = self._run(transfer, receiver if self.receiving else None)
        except BaseException as error:
            self._previous = None
            if self._groups is not None:
                self._groups.dead = True
            if self.receiving and receiver is not None:
                receiver.abort(error)
            raise
        self._previous = transfer.kept if delta else None
        return ExportReport(
            export_id,
            kind,
            self.receiving,
            len(self.buckets),
            transfer.counts,
            time.perf_counter() - start,
            handoff,
            export_id,
        )

    def _check_delta(self) -> None:
        """Deltas travel in one gather and one dtype per bucket (every rank finds the same)."""
        for bucket in self.buckets:
            sharded = [s for s in bucket.sources if s.gathers]
            if any(len(s.gathers) > 1 for s in sharded):
                raise ValueError(
                    f"delta exports gather along one mesh axis; bucket {bucket.index} "
                    f"({sharded[0].name}, ...) needs {len(sharded[0].gathers)}: keep the TP axis "
                    "(keep_axes=('tp',)) or export in full"
                )
            if len({s.dtype for s in sharded}) > 1:
                raise ValueError(
                    f"delta exports need one dtype per bucket; bucket {bucket.index} mixes "
                    f"{sorted(str(s.dtype) for s in sharded)}: pass ExportOptions(dtype=...)"
                )

    def _transfer(self, export_id: int, kind: ExportKind, *, track: bool) -> BucketTransfer:
        groups = None
        watch = None
        if self.mesh is not None and is_distributed():
            if self._groups is None or self._groups.dead:
                self._groups = make_export_groups(self.mesh, self.order, self.bound_s)
            groups = self._groups
            watch = ExportWatch.open(self._index, export_id, global_rank(), self.bound_s)
        previous = self._previous if kind == "delta" else None
        return BucketTransfer(
            manifest=self.manifest(kind, export_id),
            buckets=self.buckets,
            groups=groups,
            watch=watch,
            mesh=self.mesh,
            to_all=self.options.to == "all",
            keep_dims=self.keep_dims,
            order=self.order,
            receiving=self.receiving,
            previous=previous,
            track=track,
            plain_when_faster=self.options.plain_when_faster,
        )

    def _run(self, transfer: BucketTransfer, receiver: WeightReceiver | None) -> float:
        try:
            return self._steps(transfer, receiver)
        except WeightExportError:
            raise
        except Exception as error:
            if transfer.watch is None:
                raise
            raise transfer.watch.give_verdict(
                f"weight export {transfer.manifest.export_id}: rank {global_rank()} failed in "
                f"{transfer.watch.where}: {type(error).__name__}: {error}"
            ) from error

    def _steps(self, transfer: BucketTransfer, receiver: WeightReceiver | None) -> float:
        self._agree(transfer)
        handoff = 0.0
        if receiver is not None:
            handoff += transfer.guarded(lambda: receiver.begin(transfer.manifest), "begin")
        for bucket in self.buckets:
            ready = move_bucket(transfer, bucket)
            if receiver is not None:
                assert ready is not None
                handoff += transfer.guarded(partial(receiver.receive, ready), bucket)
            # Dropped before the next bucket is packed: two buckets at most beyond training.
            del ready
        commit = getattr(receiver, "commit", None)
        if commit is not None:
            # Before the ranks' last agreement: a commit that fails fails every rank.
            handoff += transfer.guarded(commit, "commit")
        self._finish(transfer)
        if receiver is not None:
            handoff += transfer.guarded(receiver.finish, "finish")
        return handoff

    def _agree(self, transfer: BucketTransfer) -> None:
        """Step 1: every rank exports the same plan, export and kind.

        Then, for a delta, every rank's count of changes per bucket (a second small all-
        gather).
        """
        if transfer.groups is None or transfer.watch is None:
            return
        delta = transfer.manifest.kind == "delta"  # the kind: 0 full, 1 delta, 3 paced
        kind = int(delta) + 2 * int(delta and transfer.plain_when_faster)
        head = [self.digest, transfer.manifest.export_id, kind]
        rows = self._all_gather(transfer, torch.tensor(head, dtype=torch.int64), "agreement")
        if not bool((rows == rows[0]).all()):
            kinds = {0: "full", 1: "delta", 3: "delta, plain when faster"}
            described = "; ".join(
                f"rank {r}: plan {int(row[0]):x}, export {int(row[1])}, {kinds[int(row[2])]}"
                for r, row in zip(transfer.groups.world_ranks, rows, strict=True)
            )
            raise transfer.watch.give_verdict(
                "weight export: the ranks do not export the same thing (the same model and "
                f"options, as many exports, full or delta alike): {described}"
            )
        if transfer.previous is not None:
            if transfer.plain_when_faster:
                transfer.paced = start_runs(transfer.previous.slow, transfer.kept.slow)
            counts = torch.tensor(count_changes(transfer), dtype=torch.int64)
            if not all_paced(transfer.paced, self.buckets):  # else all plain, agreed already
                transfer.all_counts = self._all_gather(transfer, counts, "changes counted")
                if transfer.plain_when_faster:
                    settle(transfer.kept.slow, self.buckets, transfer.all_counts)

    def _all_gather(
        self, transfer: BucketTransfer, vector: torch.Tensor, what: str
    ) -> torch.Tensor:
        assert transfer.groups is not None and transfer.watch is not None
        transfer.watch.post(f"the export's {what}")
        transfer.watch.raise_if_failed()
        works, rows = all_gather_vector(vector, transfer.groups)
        transfer.watch.wait(works, transfer.groups.world_ranks, on_device=rows.device.type != "cpu")
        transfer.counts.collectives += 1
        return rows.cpu()  # read element by element: on the host

    def _finish(self, transfer: BucketTransfer) -> None:
        """Step 4: every rank got through (a failed one has given the verdict instead)."""
        if transfer.groups is None or transfer.watch is None:
            return
        self._all_gather(transfer, torch.zeros(1, dtype=torch.int64), "end")


def export_weights(
    model: nn.Module, receiver: WeightReceiver | None = None, **options: object
) -> ExportReport:
    """One full export of ``model`` (every rank of its mesh calls it).

    See :class:`WeightExporter` and :class:`ExportOptions` (the keyword arguments).
    """
    return WeightExporter(model, ExportOptions(**options)).export(receiver)  # type: ignore[arg-type]
