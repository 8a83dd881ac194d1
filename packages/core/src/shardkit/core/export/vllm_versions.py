"""vLLM's worker serves one export complete until the next is complete: staged, then switched.

These functions run where vLLM's worker lives (as ``vllm_worker.py``'s do), and keep their
state on the worker object. Each bucket of an export is *staged* there (its tensors kept, in
the engine's dtype, the model untouched); the *commit* loads every staged tensor in one call
on the worker. vLLM's engine core runs such a call between two engine steps, so no forward
sees a model half-loaded. If the load raises partway, the commit puts the model back as it
was before the call (see :func:`snapshot`) and raises: the version that served before serves
on, complete.

Memory in the engine's process: the staged export (one more copy of what it changes, in
checkpoint format) until its commit; during the commit, a copy of the model's tensors as the
engine holds them (after its processing: for vLLM's CPU build the linear layers' weights are
packed into their kernels' handles, which are kept by reference, not copied).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

__all__ = [
    "commit_loads",
    "commit_staged",
    "drop_staged",
    "restored",
    "serving_version",
    "settle_held",
    "snapshot",
    "stage_on_worker",
]

_STATE = "_shardkit_versions"


@dataclass(slots=True)
class WorkerVersions:
    """What the worker serves and what it holds staged."""

    serving: int | None = None
    """The export the model holds complete (None: the weights it started with)."""
    staging: int | None = None
    """The export whose buckets are staged."""
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    held: ModelSnapshot | None = None
    """A commit made with ``hold``: the model as it was before it, until it is settled."""
    held_from: int | None = None
    """What served before that commit (served again if it is undone)."""


def _state(worker: Any) -> WorkerVersions:
    state = getattr(worker, _STATE, None)
    if state is None:
        state = WorkerVersions()
        setattr(worker, _STATE, state)
    assert isinstance(state, WorkerVersions)
    return state


def serving_version(worker: Any) -> int | None:
    """On the worker: the export its model holds complete (None: as the engine started)."""
    return _state(worker).serving


def stage_on_worker(
    worker: Any, version: int, payload: list[tuple[str, torch.Tensor]] | bytes
) -> None:
    """On the worker: keep one bucket of export ``version`` (tensors, or safetensors bytes).

    A bucket of another export drops what an earlier one staged (it failed before its commit).
    """
    state = _state(worker)
    if state.staging != version:
        state.staging, state.staged = version, []
    tensors = list(load_safetensors(payload).items()) if isinstance(payload, bytes) else payload
    state.staged.extend(tensors)


def commit_staged(
    worker: Any,
    version: int,
    model: torch.nn.Module,
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
    path: str,
    hold: bool = False,
) -> int:
    """On the worker: ``load`` export ``version``'s staged tensors in one call; its number.

    ``model`` is the worker's, put back as it was if ``load`` raises; ``path`` names the load
    in errors (``vllm_worker.commit_on_worker`` passes both, and its load). With ``hold`` the
    model as it was is kept until :func:`settle_held`: one engine rank of several commits, and
    the others may still fail theirs (a TP-sliced export), so the commit can be undone.

    Raises:
        RuntimeError: nothing of ``version`` is staged, or the load raised (the model was put
            back as it was: the version that served before serves on, and the error says so).
    """
    state = _state(worker)
    if state.staging != version:
        raise RuntimeError(
            f"export {version} has nothing staged on vLLM's worker (staged: {state.staging}); "
            f"it serves export {state.serving}"
        )
    staged, serving = state.staged, state.serving
    before = snapshot(model)
    commit_loads(worker, version, path, lambda: load(staged), partial(restored, before))
    if hold:
        state.held, state.held_from = before, serving
    return version


def restored(before: ModelSnapshot) -> str:
    """Put the model back from ``before``; how, in words (a commit's put-back)."""
    before.restore()
    return "as it was, from a copy in memory"


def commit_loads(
    worker: Any,
    version: int,
    path: str,
    load: Callable[[], None],
    put_back: Callable[[], str],
) -> int:
    """On the worker: ``load()`` makes export ``version`` serve; its number.

    The commit of an export staged elsewhere (``vllm_files.py``: in files). If ``load``
    raises, ``put_back()`` returns the model to what served before and says how; if that
    raises too, the worker serves a mix (its version None) and says so.

    Raises:
        RuntimeError: the load raised (the error says whether the model was put back).
    """
    state = _state(worker)
    if state.held is not None:  # an earlier held commit never settled: it stands
        state.held, state.held_from = None, None
    state.staging, state.staged = None, []
    try:
        load()
    except Exception as error:
        serving = state.serving
        try:
            how = put_back()
        except Exception as again:
            state.serving = None
            raise RuntimeError(
                f"vLLM's {path} of export {version} raised: {error}. Putting export "
                f"{serving} back raised too ({type(again).__name__}: {again}): the engine "
                "holds a mix of the two until a full export goes through"
            ) from error
        raise RuntimeError(
            f"vLLM's {path} of export {version} raised: {error}. The model was put back "
            f"({how}): it serves export {serving}, complete"
        ) from error
    state.serving = version
    return version


def drop_staged(worker: Any) -> None:
    """On the worker: an export that failed before its commit; what it staged is dropped."""
    state = _state(worker)
    state.staging, state.staged = None, []


def settle_held(worker: Any, keep: bool) -> int | None:
    """On the worker: a held commit kept (its snapshot dropped) or undone; what it serves.

    Undone, the model is put back as it was before that commit, and what served then serves
    again. Staged buckets of an export that never committed are dropped either way.
    """
    state = _state(worker)
    if state.held is not None:
        if not keep:
            state.held.restore()
            state.serving = state.held_from
        state.held, state.held_from = None, None
    state.staging, state.staged = None, []
    return state.serving


@dataclass(slots=True)
class ModelSnapshot:
    """A model's modules as they were: their attributes, tensors and the tensors' values."""

    modules: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], dict[str, Any], set[str]]]
    """Per module: its attributes, parameters, buffers and non-persistent buffer names."""
    values: list[tuple[torch.Tensor, torch.Tensor]]
    """Each tensor once, with a copy of its values."""

    def restore(self) -> None:
        """Put every module back: attributes, parameters and buffers, then their values."""
        for module, attributes, parameters, buffers, non_persistent in self.modules:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            # The attributes hold these containers by reference: a load mutated them.
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for tensor, copy in self.values:
                if tensor.shape == copy.shape and tensor.dtype == copy.dtype:
                    tensor.copy_(copy)  # in place: captured graphs keep their pointers
                else:
                    tensor.data = copy


def snapshot(model: torch.nn.Module) -> ModelSnapshot:
    """``model`` as it is now, to put back after a load that raised partway.

    vLLM's loads write some tensors in place and replace others, and its processing after
    loading sets attributes (the CPU build's packed kernels live in a closure on the layer):
    so each module's attributes are kept by reference and its tensors' values by copy.
    """
    modules = []
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        parameters = dict(module._parameters)
        buffers = dict(module._buffers)
        modules.append(
            (
                module,
                dict(module.__dict__),
                parameters,
                buffers,
                set(module._non_persistent_buffers_set),
            )
        )
        for tensor in [*parameters.values(), *buffers.values()]:
            if tensor is not None and id(tensor) not in seen and not tensor.is_meta:
                seen[id(tensor)] = (tensor, tensor.detach().clone())
    return ModelSnapshot(modules, list(seen.values()))
