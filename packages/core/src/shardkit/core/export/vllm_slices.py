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
    """

    def __init__(self, llm: Any, *, path: LoadPath = "auto", bound_s: float | None = None) -> None:
        self.llm = llm
        self.calls = EngineCalls(llm, bound_s)
        self.path = path
        self.dtype = engine_dtype(llm)
        self.chosen: str | None = None
        self.place: tuple[int, int] | None = None
        """(engine rank, degree) of the worker, asked once."""
        self.loaded: list[str] = []

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

    def receive(self, bucket: SlicedBucket) -> None:
        """Load the bucket's windows through the engine's own loaders."""
        assert self.chosen is not None and self.place is not None, "begin() first"
        if (bucket.engine_rank, bucket.degree) != tuple(self.place):
            raise WeightLoadError(
                f"bucket {bucket.index} holds the windows of engine rank {bucket.engine_rank} "
                f"of TP degree {bucket.degree}, but this process's vLLM worker is rank "
                f"{self.place[0]} of {self.place[1]}; nothing of it was written"
            )
        items = [(window.name, windowed(window, data)) for window, data in bucket.windows]
        try:
            self.calls.load(self.chosen, items)
        except Exception as error:
            names = ", ".join(name for name, _ in items) or "none"
            raise WeightLoadError(
                f"vLLM's {self.chosen} failed on bucket {bucket.index} ({names}) of engine rank "
                f"{bucket.engine_rank}: {type(error).__name__}: {error}. Loaded before it: "
                f"{', '.join(self.loaded) or 'none'}"
            ) from error
        self.loaded += [name for name, _ in items]

    def finish(self) -> None:
        """The export went through: forget the prefix cache the old weights computed."""
        if self.calls.reset_prefix_cache() is False:
            logger.warning("vLLM did not reset its prefix cache after the weight update")

    def abort(self, error: BaseException) -> None:
        """The export failed on some rank (the engine may hold a mix: export in full again)."""
        self.loaded = []
