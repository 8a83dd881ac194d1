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

The engine's worker is reached through ``LLM.collective_rpc`` with a function of this module.
In the same process as the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the colocated mode)
it is called directly, tensors and all. With the engine core in a process of its own (vLLM's
default), the function goes pickled, which vLLM allows only under
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and each bucket as safetensors bytes (vLLM's RPC
would turn tensors into lists). Older engines without ``collective_rpc`` are reached through
their driver worker. This module imports no vLLM: the core runs without it.

See docs/guide/export.md.

Next to split off: the engine's side (``_model_of``, ``_processed_parameters``,
``_probe_worker``, ``_choose_path``, ``_why``, ``_load_on_worker``, ``_restore_unfinished_layers``,
``_quiet``, ``_RELOAD_LOGGERS``) into ``vllm_worker.py``: these run on vLLM's worker, are reached
only through ``call(fn, ...)``, and use nothing of the loader or the receiver.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest
from shardkit.core.export.receivers import FullTensorReceiver, TensorLoader

__all__ = [
    "LoadPath",
    "VLLMReceiver",
    "engine_dtype",
    "vllm_loader",
    "vllm_receiver",
]

logger = logging.getLogger(__name__)

LoadPath = Literal["auto", "load_weights", "reload_weights"]
"""How tensors enter the engine: ``"load_weights"`` (the model's loader, weights unprocessed),
``"reload_weights"`` (the worker's in-place reload, which processes each layer again), or
``"auto"``: the first one the engine's model can take."""

# vLLM's in-place reload warns, on every call, about each layer the call leaves out ("Failed
# to load weights", "weights were not loaded"). A bucket leaves out all the others by design.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


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


def vllm_loader(llm: Any, *, path: LoadPath = "auto") -> TensorLoader:
    """A loader that puts one bucket's whole tensors into ``llm``, a ``vllm.LLM``.

    The path is chosen on the first call (see the module's docstring) and kept. Each call must
    hold whole layers: q, k and v together, gate and up together (an export's buckets do).

    Args:
        llm: a ``vllm.LLM`` (its engine core in this process or in its own).
        path: ``"auto"`` (the default) or one path forced (it must be available).

    Returns:
        A callable taking ``[(checkpoint name, whole tensor), ...]``.

    Raises:
        TypeError: ``llm`` offers no way to its worker (neither ``collective_rpc`` nor a
            driver worker).
    """
    call = _worker_call(llm)
    facts: list[EngineFacts] = []  # filled on the first call: the engine is asked once

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not facts:
            facts.append(_engine_facts(llm, call, path))
            logger.info("vLLM weights: %s (%s)", facts[0].path, facts[0].reason)
        chosen = facts[0]
        converted = [(name, _in_dtype(tensor, chosen.dtype)) for name, tensor in tensors]
        # Across processes vLLM's RPC turns tensors into lists: they go as safetensors bytes.
        payload = (
            converted
            if chosen.same_process
            else save_safetensors({name: t.contiguous() for name, t in converted})
        )
        try:
            call(_load_on_worker, chosen.path, payload)
        except Exception as error:
            names = ", ".join(name for name, _ in tensors) or "none"
            raise WeightLoadError(
                f"vLLM's {chosen.path} failed on a bucket of {len(tensors)} tensor(s) "
                f"({names}): {type(error).__name__}: {error}. These tensors may be partly "
                "written: the engine holds a mix of old and new weights until a full export "
                "goes through"
            ) from error

    return load


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
    """Exports into an in-process ``vllm.LLM``: delta exports rebuilt, buckets loaded whole.

    On top of :class:`FullTensorReceiver`, it checks each manifest before anything is written:
    floating tensors in the engine's dtype and, where the engine was started from a local
    folder, names and shapes that its checkpoint has. After an export it empties the engine's
    prefix cache, whose keys and values the old weights computed.

    Args:
        llm: the ``vllm.LLM`` that receives.
        path: the loading path (see :data:`LoadPath`).
        keep_mirror: keep the last export's tensors, for delta exports (see
            :class:`FullTensorReceiver`).
    """

    def __init__(self, llm: Any, *, path: LoadPath = "auto", keep_mirror: bool = True) -> None:
        super().__init__(vllm_loader(llm, path=path), keep_mirror=keep_mirror)
        self.llm = llm
        self.dtype = engine_dtype(llm)
        self._checkpoint: dict[str, tuple[int, ...]] | None = _checkpoint_shapes(llm)

    def begin(self, manifest: ExportManifest) -> None:
        """Check the manifest against the engine, then as the base does.

        Raises:
            WeightLoadError: a floating tensor in another dtype than the engine's, a name or
                shape the engine's checkpoint does not have, or a delta export the receiver
                cannot apply; nothing was written.
        """
        problems = [
            f"{entry.name}: sent as {entry.dtype}, the engine computes in {self.dtype}"
            for entry in manifest.tensors
            if entry.dtype.is_floating_point and entry.dtype != self.dtype
        ]
        if self._checkpoint is not None:
            for entry in manifest.tensors:
                shape = self._checkpoint.get(entry.name)
                if shape is None:
                    problems.append(f"{entry.name}: not a tensor of the engine's checkpoint")
                elif shape != entry.shape:
                    problems.append(
                        f"{entry.name}: sent as {list(entry.shape)}, the engine's checkpoint "
                        f"holds {list(shape)}"
                    )
        if problems:
            raise WeightLoadError(
                f"export {manifest.export_id} does not fit the vLLM engine; nothing was "
                "written: " + "; ".join(problems)
            )
        super().begin(manifest)

    def finish(self) -> None:
        """The export went through: forget the engine's prefix cache (old weights' keys)."""
        super().finish()
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None and reset() is False:
            logger.warning("vLLM did not reset its prefix cache after the weight update")


def _checkpoint_shapes(llm: Any) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes of the engine's checkpoint, read from its safetensors headers.

    None where the engine was not started from a local folder of safetensors files.
    """
    source = getattr(getattr(llm.llm_engine, "model_config", None), "model", None)
    folder = Path(source) if isinstance(source, str) else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else []
    if not files:
        logger.info(
            "vLLM receiver: no local safetensors checkpoint; manifests checked for dtype only"
        )
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            names: list[str] = list(opened.keys())  # a safetensors handle is not iterable
            for name in names:
                shapes[name] = tuple(opened.get_slice(name).get_shape())
    return shapes


def vllm_receiver(llm: Any, *, path: LoadPath = "auto") -> VLLMReceiver:
    """The receiver for an in-process ``vllm.LLM`` (see :class:`VLLMReceiver`)."""
    return VLLMReceiver(llm, path=path)


# -- the engine's side ------------------------------------------------------------------------
#
# The functions below run on vLLM's worker (in this process, or pickled by reference into the
# engine core's): they take the worker first, as collective_rpc calls them.


def _worker_call(llm: Any) -> Any:
    """A callable ``call(fn, *args)`` running ``fn(worker, *args)`` on the engine's worker."""
    if callable(getattr(llm, "collective_rpc", None)):

        def rpc(fn: Any, *args: Any) -> Any:
            results = llm.collective_rpc(fn, args=args)
            return results[0]

        return rpc
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    if worker is None:
        raise TypeError(
            f"{type(llm).__name__} offers no way to its worker: neither collective_rpc nor "
            "llm_engine.model_executor.driver_worker (an in-process vllm.LLM is needed)"
        )

    def direct(fn: Any, *args: Any) -> Any:
        return fn(worker, *args)

    return direct


def _engine_facts(llm: Any, call: Any, path: LoadPath) -> EngineFacts:
    try:
        chosen, dtype, reason, worker_pid = call(_probe_worker, path)
    except TypeError as error:
        if "serializ" not in str(error):
            raise
        raise WeightLoadError(
            "vLLM's engine core runs in another process and refuses the function that loads "
            "the weights on its worker: start the engine with "
            "VLLM_ALLOW_INSECURE_SERIALIZATION=1, or in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0); nothing was written"
        ) from error
    if chosen is None:
        raise WeightLoadError(f"this vLLM engine cannot take weights in place: {reason}")
    return EngineFacts(chosen, dtype, reason, same_process=worker_pid == os.getpid())


def _model_of(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is not None and callable(getattr(runner, "get_model", None)):
        return runner.get_model()
    if runner is not None and hasattr(runner, "model"):
        return runner.model
    return worker.get_model()


def _processed_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters of vLLM's layers whose weight loader is gone (processed after loading).

    vLLM's linear and embedding layers carry a ``quant_method`` and give their parameters a
    ``weight_loader``; a build that repacks them replaces the parameter with one without.
    """
    found = []
    for module_name, module in model.named_modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                found.append(f"{module_name}.{name}")
    return found


def _probe_worker(worker: Any, path: LoadPath) -> tuple[str | None, torch.dtype, str, int]:
    """On the worker: (the path to use or None, the model's dtype, why, the worker's pid)."""
    found = _choose_path(worker, path)
    return (*found, os.getpid())


def _choose_path(worker: Any, path: LoadPath) -> tuple[str | None, torch.dtype, str]:
    config = worker.model_runner.model_config
    dtype = config.dtype
    model = _model_of(worker)
    has_reload = callable(getattr(worker, "reload_weights", None))
    processed = _processed_parameters(model)
    quantized = getattr(config, "quantization", None) is not None
    loader_ok = not processed and not quantized
    if path == "load_weights":
        return ("load_weights", dtype, "forced") if loader_ok else (None, dtype, _why(processed))
    if path == "reload_weights":
        if has_reload:
            return "reload_weights", dtype, "forced"
        return None, dtype, "the worker has no reload_weights (vLLM too old)"
    if loader_ok:
        return "load_weights", dtype, "the model's weight loaders are intact"
    if has_reload:
        why = "quantized" if quantized else f"weights processed after loading ({processed[0]})"
        return "reload_weights", dtype, why
    return None, dtype, _why(processed) + ", and the worker has no reload_weights"


def _why(processed: Sequence[str]) -> str:
    if not processed:
        return "the model is quantized: its loader would not requantize"
    return (
        f"{len(processed)} parameter(s) were processed after loading and lost their weight "
        f"loader (first: {processed[0]}), so the model's load_weights cannot take them"
    )


def _load_on_worker(
    worker: Any, path: str, payload: list[tuple[str, torch.Tensor]] | bytes
) -> None:
    """On the worker: load one bucket's tensors (or their safetensors bytes) by ``path``."""
    tensors = list(load_safetensors(payload).items()) if isinstance(payload, bytes) else payload
    if path == "reload_weights":
        with _quiet(_RELOAD_LOGGERS):
            try:
                worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
            except Exception as error:
                restored = _restore_unfinished_layers(_model_of(worker))
                raise RuntimeError(
                    f"{type(error).__name__}: {error} (the layers not yet processed "
                    + (
                        "were given back their previous weights)"
                        if restored
                        else "could not be restored: this vLLM's reload internals differ)"
                    )
                ) from error
        return
    model = _model_of(worker)
    with torch.no_grad():
        model.load_weights(iter(tensors))


def _restore_unfinished_layers(model: torch.nn.Module) -> bool:
    """After a failed ``reload_weights``, puts back the previous tensors of unprocessed layers.

    Every layer the reload had set up but not yet processed gets its previous (kernel) tensors
    back, so the engine runs on. Returns False where this vLLM's reload keeps its state
    otherwise (nothing done).

    vLLM's reload first moves every layer's tensors aside and puts meta tensors in their place,
    then processes each layer once all its weights came; an error in between would leave the
    rest on meta (every later forward and reload fails).
    """
    try:
        layerwise = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
    except ImportError:
        return False
    infos = getattr(layerwise, "LAYERWISE_INFO", None)
    place = getattr(layerwise, "_place_kernel_tensors", None)
    if infos is None or place is None:
        return False
    for layer in model.modules():
        info = infos.get(layer)
        if info is None or not info.can_load():
            continue  # never set up, or processed: it holds the new values
        if info.kernel_tensors is not None:
            place(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return True


@contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    """Raises the named loggers to ERROR for the block (their own levels restored after)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the engine's dtype where it is floating (a no-op when it already is)."""
    if tensor.dtype.is_floating_point and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor
