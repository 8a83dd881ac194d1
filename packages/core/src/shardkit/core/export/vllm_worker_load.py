"""vLLM's worker taking a bucket: the path chosen, the load, the commit of a staged version.

These functions run where vLLM's worker lives: in the trainer's process (the engine core in
it), or in the engine core's own process, reached there by method name through the worker
extension (``vllm_worker``), which needs no pickled function (vLLM refuses those unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). They take the worker first, as vLLM's
``collective_rpc`` calls a function, and use nothing of the loader or the receiver
(``vllm.py``) or of the way they are reached (``vllm_rpc.py``).

The path (see ``vllm.py``): the model's own ``load_weights`` where its weight loaders are
intact, else the worker's ``reload_weights``, which processes each layer again.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from safetensors.torch import load as load_safetensors

from shardkit.core.export.vllm_versions import commit_staged

__all__ = [
    "LoadPath",
    "choose_path",
    "commit_on_worker",
    "load_on_worker",
    "model_of",
    "probe_worker",
]

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


def commit_on_worker(worker: Any, version: int, path: str, hold: bool = False) -> int:
    """On the worker: export ``version``'s staged buckets loaded by ``path`` in one call.

    See :func:`~shardkit.core.export.vllm_versions.commit_staged` (the model put back as it
    was if the load raises; with ``hold``, kept so until settled).
    """
    model = model_of(worker)
    return commit_staged(
        worker, version, model, lambda tensors: load_on_worker(worker, path, tensors), path, hold
    )


def model_of(worker: Any) -> Any:
    """The worker's model (``model_runner.get_model()`` where vLLM offers it)."""
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


def probe_worker(worker: Any, path: LoadPath) -> tuple[str | None, str, str, int]:
    """On the worker: (the path to use or None, the model's dtype's name, why, its pid).

    Plain values only (the dtype by name): vLLM's RPC carries them without pickle.
    """
    chosen, dtype, reason = choose_path(worker, path)
    return chosen, str(dtype).removeprefix("torch."), reason, os.getpid()


def choose_path(worker: Any, path: LoadPath) -> tuple[str | None, torch.dtype, str]:
    """On the worker: the path its model and worker allow (None: none), its dtype, and why."""
    config = worker.model_runner.model_config
    dtype = config.dtype
    model = model_of(worker)
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


def load_on_worker(
    worker: Any, path: str, payload: Iterable[tuple[str, torch.Tensor]] | bytes
) -> None:
    """On the worker: load one bucket's tensors (or their safetensors bytes) by ``path``.

    The tensors may come from an iterator (read from files one at a time, ``vllm_files``):
    each call takes whole layers, in one pass.
    """
    tensors = list(load_safetensors(payload).items()) if isinstance(payload, bytes) else payload
    if path == "reload_weights":
        with _quiet(_RELOAD_LOGGERS):
            try:
                worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
            except Exception as error:
                restored = _restore_unfinished_layers(model_of(worker))
                raise RuntimeError(
                    f"{type(error).__name__}: {error} (the layers not yet processed "
                    + (
                        "were given back their previous weights)"
                        if restored
                        else "could not be restored: this vLLM's reload internals differ)"
                    )
                ) from error
        return
    model = model_of(worker)
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
