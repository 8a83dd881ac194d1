"""vLLM as an export's receiver: each bucket's whole tensors put into a running ``vllm.LLM``.

vLLM has no one call that loads new weights on every build. The model's own ``load_weights``
takes checkpoint-format tensors (q, k and v apart) through each parameter's ``weight_loader``;
it is what CUDA builds of unquantized models use. But a build that processes weights after
loading (vLLM's CPU build repacks every linear layer's weight for its kernels and leaves an
empty tensor without a loader; quantized models requantize) cannot take them so: the call
fails partway with the embeddings already replaced. Those builds offer the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which loads each layer
again and runs its processing, as long as one call holds whole layers (the export's buckets
do). So the path is chosen by what the engine's model and worker offer, not by version.

The engine's worker is reached through ``LLM.collective_rpc`` (``vllm_rpc.py``): in the same
process as the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the colocated mode) with a
function, tensors and all; with the engine core in a process of its own (vLLM's default) by
method name through shardkit's worker extension (``worker_extension_cls=EXTENSION``), each
bucket as safetensors bytes (vLLM's RPC would turn tensors into lists), every call bounded by
the export's bound. What runs on the worker is ``vllm_worker.py``. The route and the path are
settled in ``begin``, before the first bucket. This module imports no vLLM: the core runs
without it.

See docs/guide/export.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from safetensors.torch import save as save_safetensors

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export.messages import ExportManifest
from shardkit.core.export.mirror_files import MirrorFiles
from shardkit.core.export.receivers import FullTensorReceiver, TensorLoader
from shardkit.core.export.vllm_checks import check_manifest, checkpoint_shapes
from shardkit.core.export.vllm_rpc import EngineCalls
from shardkit.core.export.vllm_worker import EXTENSION
from shardkit.core.export.vllm_worker_load import LoadPath

__all__ = [
    "EXTENSION",
    "LoadPath",
    "VLLMReceiver",
    "check_manifest",
    "checkpoint_shapes",
    "engine_dtype",
    "vllm_loader",
    "vllm_receiver",
]

logger = logging.getLogger(__name__)

_PATHS: dict[str, Literal["load_weights", "reload_weights"]] = {
    "load_weights": "load_weights",
    "reload_weights": "reload_weights",
}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine's worker reports about its model, once, before the first load."""

    path: Literal["load_weights", "reload_weights"]
    """The loading path chosen for this engine."""
    dtype: torch.dtype
    """The model's dtype (vLLM's ``model_config.dtype``): what floating tensors must arrive in."""
    reason: str
    """Why this path (for the log and for errors)."""
    same_process: bool
    """The worker runs in this process: tensors are handed over as they are."""


def vllm_loader(llm: Any, *, path: LoadPath = "auto", bound_s: float | None = None) -> TensorLoader:
    """A loader that puts one bucket's whole tensors into ``llm``, a ``vllm.LLM``.

    The route to the worker and the path are chosen on the first call (see the module's
    docstring) and kept. Each call must hold whole layers: q, k and v together, gate and up
    together (an export's buckets do).

    Args:
        llm: a ``vllm.LLM`` (its engine core in this process or in its own).
        path: ``"auto"`` (the default) or one path forced (it must be available).
        bound_s: the longest wait for one call into an engine in another process (default
            ``SHARDKIT_EXPORT_BOUND``).

    Returns:
        A callable taking ``[(checkpoint name, whole tensor), ...]``.

    Raises:
        TypeError: ``llm`` offers no way to its worker (neither ``collective_rpc`` nor a
            driver worker).
    """
    return _Loader(EngineCalls(llm, bound_s), path)


class _Loader:
    """:func:`vllm_loader`'s callable: asks the engine once, then loads bucket by bucket."""

    def __init__(self, calls: EngineCalls, path: LoadPath) -> None:
        self.calls = calls
        self.path = path
        self.facts: EngineFacts | None = None

    def ready(self) -> EngineFacts:
        """The route and the path, settled once.

        A receiver asks in ``begin``: before the first bucket.

        Raises:
            WeightExportError: no route reaches the engine's worker (a setting it lacks).
            WeightLoadError: the engine cannot take weights in place.
        """
        if self.facts is None:
            chosen, dtype, reason, worker_pid = self.calls.probe(self.path)
            found = _PATHS.get(chosen or "")
            if found is None:
                raise WeightLoadError(f"this vLLM engine cannot take weights in place: {reason}")
            self.facts = EngineFacts(
                found, getattr(torch, dtype), reason, same_process=worker_pid == os.getpid()
            )
            logger.info("vLLM weights: %s (%s)", chosen, reason)
        return self.facts

    def _payload(self, tensors: list[tuple[str, torch.Tensor]]) -> Any:
        chosen = self.ready()
        converted = [(name, _in_dtype(tensor, chosen.dtype)) for name, tensor in tensors]
        # Across processes vLLM's RPC turns tensors into lists: they go as safetensors bytes.
        if chosen.same_process:
            return converted
        return save_safetensors({name: t.contiguous() for name, t in converted})

    def stage(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Stage one bucket of export ``version`` on the worker (``vllm_versions.py``)."""
        self.calls.stage(version, self._payload(tensors))

    def commit(self, version: int, files: tuple[list[Any], list[Any]] | None = None) -> None:
        """Load export ``version`` in one call on the worker: its staged buckets, or ``files``.

        ``files``: the files to load and those to put back if that raises
        (``vllm_files.py``), where nothing was staged on the worker.

        Raises:
            WeightExportError: the engine did not answer within the bound.
            WeightLoadError: the load raised (the worker put its model back as it was), or
                the worker refused the files (nothing loaded).
        """
        chosen = self.ready()
        try:
            if files is None:
                self.calls.commit(version, chosen.path)
            else:
                self.calls.commit_files(version, chosen.path, *files)
        except WeightExportError:
            raise
        except Exception as error:
            raise WeightLoadError(f"{type(error).__name__}: {error}") from error

    def __call__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        chosen = self.ready()
        payload = self._payload(tensors)
        try:
            self.calls.load(chosen.path, payload)
        except WeightExportError:
            raise  # the engine did not answer: the export's verdict, as it is
        except Exception as error:
            names = ", ".join(name for name, _ in tensors) or "none"
            raise WeightLoadError(
                f"vLLM's {chosen.path} failed on a bucket of {len(tensors)} tensor(s) "
                f"({names}): {type(error).__name__}: {error}. These tensors may be partly "
                "written: the engine holds a mix of old and new weights until a full export "
                "goes through"
            ) from error


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype of ``llm``'s model: the dtype an export into it must send.

    Raises:
        TypeError: ``llm`` has no ``llm_engine.model_config.dtype`` (not a ``vllm.LLM``).
    """
    try:
        dtype = llm.llm_engine.model_config.dtype
    except AttributeError as error:
        raise TypeError(
            f"{type(llm).__name__} is not a vllm.LLM (no llm_engine.model_config.dtype)"
        ) from error
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"vLLM's model_config.dtype is {dtype!r}, not a torch.dtype")
    return dtype


class VLLMReceiver(FullTensorReceiver):
    """Exports into a ``vllm.LLM``: delta exports rebuilt, buckets loaded whole, all at once.

    Each bucket is staged on the engine's worker and the commit loads them all in one call
    there, between two engine steps (``vllm_versions.py``): the engine serves one export
    complete until the next is, and a load that raises leaves the last one serving. Its
    :meth:`serving_version` asks the worker.

    On top of :class:`FullTensorReceiver`, it checks each manifest before anything is written:
    floating tensors in the engine's dtype and, where the engine was started from a local
    folder, names and shapes that its checkpoint has. After an export it empties the engine's
    prefix cache, whose keys and values the old weights computed.

    Args:
        llm: the ``vllm.LLM`` that receives.
        path: the loading path (see :data:`LoadPath`).
        keep_mirror: keep the last export's tensors, for delta exports (see
            :class:`FullTensorReceiver`).
        bound_s: the longest wait for one call into an engine in another process (default
            ``SHARDKIT_EXPORT_BOUND``): past it the export fails on every rank.
        all_or_nothing: stage and commit (the default); False loads each bucket as it comes.
        mirror_dir: keep the mirror in files under this folder, not in memory (see
            :class:`FullTensorReceiver`): deltas at one bucket's memory. All or nothing, each
            export is written to files beside the last one and the engine's worker, on this
            host, loads it from them at the commit and puts the last one back from its files
            if the load raises (``vllm_files.py``): versions with no copy of the model held
            in memory on either side (the first export into an engine excepted: nothing is in
            files yet, so the worker copies the engine's tensors to put back).
    """

    loads_back_itself = True  # the worker puts its model back (vllm_versions.py)

    def __init__(
        self,
        llm: Any,
        *,
        path: LoadPath = "auto",
        keep_mirror: bool = True,
        bound_s: float | None = None,
        all_or_nothing: bool = True,
        mirror_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._loader = _Loader(EngineCalls(llm, bound_s), path)
        super().__init__(
            self._loader,
            keep_mirror=keep_mirror,
            all_or_nothing=all_or_nothing,
            mirror_dir=mirror_dir,
        )
        self.llm = llm
        self.dtype = engine_dtype(llm)
        self._checkpoint: dict[str, tuple[int, ...]] | None = _checkpoint_shapes(llm)

    def begin(self, manifest: ExportManifest) -> None:
        """Check the manifest against the engine, then as the base does.

        Raises:
            WeightExportError: no route reaches the engine's worker (a setting it lacks, named)
                or the engine did not answer within the bound; nothing was written.
            WeightLoadError: a floating tensor in another dtype than the engine's, a name or
                shape the engine's checkpoint does not have, or a delta export the receiver
                cannot apply; nothing was written.
        """
        self._loader.ready()  # the route and the path, before the first bucket
        check_manifest(manifest, self.dtype, self._checkpoint)
        super().begin(manifest)

    @property
    def _commits_files(self) -> bool:
        """All or nothing with the mirror in files: the worker loads the export from them."""
        return self.all_or_nothing and self._mirror_in_files

    @property
    def _patches_mirror(self) -> bool:
        # Committed from files, the last export's files stay whole until the commit: they
        # are what the worker puts back if the load raises.
        return not self._commits_files and super()._patches_mirror

    @property
    def _keeps_tensors(self) -> bool:
        return not self._commits_files and super()._keeps_tensors

    def _stage(self, names: list[str], tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._commits_files:
            return  # written to files as they came: the commit names them
        assert self._manifest is not None
        self._loader.stage(self._manifest.export_id, tensors)

    def _apply(self) -> None:
        assert self._manifest is not None
        files = self._export_files() if self._commits_files else None
        self._loader.commit(self._manifest.export_id, files)
        self._forget_prefixes()  # at once: their keys and values are the old weights'

    def _export_files(self) -> tuple[list[Any], list[Any]]:
        """The files the worker loads, and those it puts back if the load raises.

        To load: this export's file of each tensor where it wrote one, else the last
        export's. To put back: the last export's of the same tensors (none where not all are
        held).
        """
        assert self._manifest is not None
        mirror, written = self.mirror, self._next_mirror
        assert isinstance(mirror, MirrorFiles) and isinstance(written, MirrorFiles)
        names = [entry.name for entry in self._manifest.tensors]
        load = [[n, *(written if n in written else mirror).file_of(n)] for n in names]
        held = self.version is not None and all(n in mirror for n in names)
        back = [[n, *mirror.file_of(n)] for n in names] if held else []
        return load, back

    def serving_version(self) -> int | None:
        """The export vLLM's worker serves, complete (None: the weights it started with).

        Raises:
            WeightExportError: the engine did not answer within the bound.
        """
        return self._loader.calls.serving_version()

    def finish(self) -> None:
        """The export went through: forget the engine's prefix cache (old weights' keys)."""
        super().finish()
        if not self.all_or_nothing:
            self._forget_prefixes()

    def _forget_prefixes(self) -> None:
        if self._loader.calls.reset_prefix_cache() is False:
            logger.warning("vLLM did not reset its prefix cache after the weight update")


def _checkpoint_shapes(llm: Any) -> dict[str, tuple[int, ...]] | None:
    return checkpoint_shapes(getattr(getattr(llm.llm_engine, "model_config", None), "model", None))


def vllm_receiver(
    llm: Any,
    *,
    path: LoadPath = "auto",
    bound_s: float | None = None,
    keep_mirror: bool = True,
    all_or_nothing: bool = True,
    mirror_dir: str | os.PathLike[str] | None = None,
) -> VLLMReceiver:
    """The receiver for a ``vllm.LLM`` (see :class:`VLLMReceiver`).

    ``keep_mirror=False, all_or_nothing=False`` is the leanest: full exports only, each bucket
    loaded as it arrives, no copy of the model kept (docs/guide/export.md, "A sync's peak").
    ``mirror_dir=...`` takes deltas and keeps versions with the model's copies in files, not
    memory (``all_or_nothing=False`` as well: streamed, no versions).
    """
    return VLLMReceiver(
        llm,
        path=path,
        bound_s=bound_s,
        keep_mirror=keep_mirror,
        all_or_nothing=all_or_nothing,
        mirror_dir=mirror_dir,
    )


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the engine's dtype where it is floating (a no-op when it already is)."""
    if tensor.dtype.is_floating_point and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor
