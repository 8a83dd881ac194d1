"""vLLM as a TP-sliced export's receiver: one engine rank's windows into its worker.

Each training process holds one rank of a vLLM engine of TP degree K (vLLM's
``external_launcher``, the engine in the trainer's process: verl's hybrid engine) and a
:class:`VLLMSliceReceiver` on it. A :class:`~shardkit.core.export.tp_export.SlicedExporter`
hands it this engine rank's window of every tensor, and it loads them through vLLM's own path
(``vllm_worker_load.load_on_worker``: the model's ``load_weights``, or the worker's
``reload_weights`` where the build processes weights after loading, as vLLM's CPU build
does), each window as a :class:`~shardkit.core.export.windowed_weight.WindowedWeight`: the
engine's loaders narrow it to their rank's part, which is exactly the window, so they place
it in their fused layout themselves and refuse a window that is not theirs.

Before the first bucket ``begin`` checks the dtype and that the worker is this engine rank of
a degree-K engine. This module imports no vLLM: the core runs without it.

All or nothing (the default): each bucket's windows are staged on the worker, and the
exporter's ``commit`` (after the last bucket, before the trainer ranks' last agreement) loads
them in one call, keeping the engine rank's model as it was until every trainer rank agreed.
If any rank's commit (or anything after it) fails, ``abort`` puts the model back on every
engine rank: the engine serves the version it held, on all its ranks, never one rank's new
windows beside another's old ones. ``version`` is the export the engine rank holds complete.
Memory: this rank's windows of the whole export (1/K of the model, in the engine's dtype)
until the commit, and during the commit until the agreement a copy of the engine rank's
tensors (``vllm_versions.snapshot``). ``all_or_nothing=False`` loads each bucket as it comes
(one bucket held; a failed export leaves a mix, ``version`` None, until one goes through).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportManifest
from shardkit.core.export.tp_export import SlicedBucket
from shardkit.core.export.vllm import engine_dtype
from shardkit.core.export.vllm_rpc import EngineCalls
from shardkit.core.export.vllm_slices_worker import tp_place_of_worker
from shardkit.core.export.vllm_worker import LoadPath
from shardkit.core.export.windowed_weight import windowed

__all__ = ["VLLMSliceReceiver", "tp_place_of_worker"]

logger = logging.getLogger(__name__)


class VLLMSliceReceiver:
    """Loads one engine rank's windows into a ``vllm.LLM`` whose worker runs in this process.

    Args:
        llm: this process's ``vllm.LLM`` (one rank of a TP engine, ``external_launcher``).
        path: the loading path (see :data:`~shardkit.core.export.vllm_worker.LoadPath`).
        bound_s: the longest wait for one call into the engine (``SHARDKIT_EXPORT_BOUND``).
        all_or_nothing: stage every bucket and load them at the commit, undone on every
            engine rank if the export fails anywhere (the default); False loads each bucket
            as it comes.
    """

    def __init__(
        self,
        llm: Any,
        *,
        path: LoadPath = "auto",
        bound_s: float | None = None,
        all_or_nothing: bool = True,
    ) -> None:
        self.llm = llm
        self.calls = EngineCalls(llm, bound_s)
        self.path = path
        self.all_or_nothing = all_or_nothing
        self.dtype = engine_dtype(llm)
        self.chosen: str | None = None
        self.place: tuple[int, int] | None = None
        """(engine rank, degree) of the worker, asked once."""
        self.loaded: list[str] = []
        """This export's tensors loaded (streaming) or staged (all or nothing) so far."""
        self.version: int | None = None
        """The export this engine rank holds complete (None: the weights it started with, or
        a mix after a failed export that streamed)."""
        self._export: int | None = None
        self._held = False

    def begin(self, manifest: ExportManifest) -> None:
        """Settle the path and the worker's place; check dtypes. Nothing is written.

        Raises:
            WeightExportError: the engine's worker is in another process.
            WeightLoadError: the engine cannot take weights in place, or a floating tensor
                comes in another dtype than the engine's.
        """
        if self.chosen is None:
            chosen, _, reason, pid = self.calls.probe(self.path)
            if pid != os.getpid():
                raise WeightExportError(
                    "VLLMSliceReceiver loads each engine rank in the training process that "
                    "holds it (vLLM's external_launcher); this engine's worker runs in process "
                    f"{pid}: use VLLMRemoteSliceReceiver (vllm_slices_remote.py) for workers "
                    "of their own; nothing was written"
                )
            if chosen is None:
                raise WeightLoadError(f"this vLLM engine cannot take weights in place: {reason}")
            self.chosen = chosen
            self.place = self.llm.collective_rpc(tp_place_of_worker)[0]
            logger.info(
                "vLLM TP-sliced weights: %s (%s), engine rank %s", chosen, reason, self.place
            )
        problems = [
            f"{entry.name}: sent as {entry.dtype}, the engine computes in {self.dtype}"
            for entry in manifest.tensors
            if entry.dtype.is_floating_point and entry.dtype != self.dtype
        ]
        if problems:
            raise WeightLoadError(
                f"export {manifest.export_id} does not fit the vLLM engine; nothing was "
                "written: " + "; ".join(problems)
            )
        self.loaded = []
        self._export = manifest.export_id

    def receive(self, bucket: SlicedBucket) -> None:
        """Stage the bucket's windows on the worker, or load them (``all_or_nothing=False``)."""
        assert self.chosen is not None and self.place is not None, "begin() first"
        if (bucket.engine_rank, bucket.degree) != tuple(self.place):
            raise WeightLoadError(
                f"bucket {bucket.index} holds the windows of engine rank {bucket.engine_rank} "
                f"of TP degree {bucket.degree}, but this process's vLLM worker is rank "
                f"{self.place[0]} of {self.place[1]}; nothing of it was written"
            )
        items = [(window.name, windowed(window, data)) for window, data in bucket.windows]
        try:
            if self.all_or_nothing:
                assert self._export is not None
                self.calls.stage(self._export, items)
            else:
                self.version = None  # a mix from here until this export goes through
                self.calls.load(self.chosen, items)
        except Exception as error:
            names = ", ".join(name for name, _ in items) or "none"
            done = "Staged" if self.all_or_nothing else "Loaded"
            raise WeightLoadError(
                f"vLLM's {self.chosen} failed on bucket {bucket.index} ({names}) of engine rank "
                f"{bucket.engine_rank}: {type(error).__name__}: {error}. {done} before it: "
                f"{', '.join(self.loaded) or 'none'}"
            ) from error
        self.loaded += [name for name, _ in items]

    def commit(self) -> None:
        """Load every staged window in one call, keeping the model as it was until settled.

        Raises:
            WeightLoadError: the load raised; this engine rank was put back as it was.
        """
        if not self.all_or_nothing:
            return
        assert self.chosen is not None and self._export is not None, "begin() first"
        try:
            self.calls.commit(self._export, self.chosen, hold=True)
        except Exception as error:
            raise WeightLoadError(
                f"vLLM's {self.chosen} of export {self._export} failed at its commit on engine "
                f"rank {self.place[0] if self.place else '?'}: {error}"
            ) from error
        self._held = True

    def finish(self) -> None:
        """The export went through: its commit kept, the prefix cache forgotten."""
        if self._held:
            self.calls.settle(keep=True)
            self._held = False
        self.version = self._export
        if self.calls.reset_prefix_cache() is False:
            logger.warning("vLLM did not reset its prefix cache after the weight update")

    def abort(self, error: BaseException) -> None:
        """The export failed on some rank: this engine rank's commit undone, if it made one.

        All or nothing, the engine rank then holds the version it held before (``version``);
        streaming, it may hold a mix (export in full again).
        """
        self.loaded = []
        if self.all_or_nothing and self.chosen is not None:
            try:  # the held commit undone; anything staged dropped
                self.calls.settle(keep=False)
            except Exception as failure:  # the export's own error is what the caller raises
                logger.error("vLLM's engine rank could not undo its commit: %s", failure)
                self.version = None  # what it holds is not known
        self._held = False
