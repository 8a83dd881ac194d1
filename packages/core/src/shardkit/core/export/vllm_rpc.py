"""Reaching vLLM's worker from an export: by which route, and never for longer than the bound.

Two routes reach the worker:

- *by method name*, where the engine was started with ``worker_extension_cls=EXTENSION``
  (``vllm_worker.ShardkitWorkerExtension``): ``collective_rpc("shardkit_load", ...)`` sends a
  string, an int and bytes, which vLLM's RPC carries as they are;
- *by function* (``collective_rpc(load_on_worker, ...)``), where the engine core runs in this
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the function is called, nothing is sent) or
  the user allowed pickle (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

An engine core in its own process with neither setting has no route: its input thread would
die decoding the pickled function and the call would never be answered (vLLM's client waits
on it without a limit). So that is refused before the first bucket, with a
:class:`~shardkit.core.errors.WeightExportError` naming both settings.

And every call into an engine core in another process waits at most the export's bound
(``SHARDKIT_EXPORT_BOUND``, or the receiver's ``bound_s``): the call runs on a helper thread,
and a call still unanswered then (a dead input thread, a hung engine) raises instead; the
exporter turns that into the verdict every trainer rank raises. The helper thread is a daemon
left waiting on vLLM's answer: nothing else can end a wait that vLLM itself does not bound.
In this process the calls are made directly (there is no thread of vLLM's to die).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from shardkit.core.errors import WeightExportError
from shardkit.core.export.vllm_files import commit_files_on_worker
from shardkit.core.export.vllm_versions import serving_version, settle_held, stage_on_worker
from shardkit.core.export.vllm_worker import EXTENSION
from shardkit.core.export.vllm_worker_load import commit_on_worker, load_on_worker, probe_worker
from shardkit.core.runtime.export.export_groups import export_bound_s

__all__ = ["EngineCalls", "bounded"]

_R = TypeVar("_R")
_TRUE = ("1", "true", "yes")


def bounded(call: Callable[[], _R], what: str, bound_s: float) -> _R:
    """``call()``'s result, or a ``WeightExportError`` once ``bound_s`` passed without one.

    Its own error is raised as it is.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the caller's thread, raised there
            outcome.append((False, error))

    helper = threading.Thread(target=run, name="shardkit-engine-call", daemon=True)
    helper.start()
    helper.join(bound_s)
    if not outcome:
        raise WeightExportError(
            f"vLLM's engine did not answer {what} within {bound_s:g} s (SHARDKIT_EXPORT_BOUND): "
            "its engine core process, or the thread that reads its input, may be dead"
        )
    ok, value = outcome[0]
    if not ok:
        raise value
    result: _R = value
    return result


@dataclass(frozen=True, slots=True)
class _Route:
    how: Literal["extension", "function", "driver"]
    in_process: bool


class EngineCalls:
    """The calls an export makes into one ``vllm.LLM``'s worker, each bounded.

    Args:
        llm: the engine (its core in this process or in its own).
        bound_s: the longest wait for one call (default ``SHARDKIT_EXPORT_BOUND``, 300 s).

    Raises:
        TypeError: ``llm`` offers no way to its worker (neither ``collective_rpc`` nor a
            driver worker).
    """

    def __init__(self, llm: Any, bound_s: float | None = None) -> None:
        self.llm = llm
        self.bound_s = export_bound_s(bound_s)
        engine = getattr(llm, "llm_engine", None)
        if not callable(getattr(llm, "collective_rpc", None)):
            executor = getattr(engine, "model_executor", None)
            if getattr(executor, "driver_worker", None) is None:
                raise TypeError(
                    f"{type(llm).__name__} offers no way to its worker: neither collective_rpc "
                    "nor llm_engine.model_executor.driver_worker (a vllm.LLM is needed)"
                )
            self._route: _Route | None = _Route("driver", in_process=True)
        else:
            self._route = None  # chosen on the first call (see ``route``)

    def route(self) -> _Route:
        """How the worker is reached (checked once, before the first bucket).

        Raises:
            WeightExportError: the engine core runs in another process and was started with
                neither shardkit's worker extension nor ``VLLM_ALLOW_INSECURE_SERIALIZATION``.
        """
        if self._route is not None:
            return self._route
        engine = self.llm.llm_engine
        parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
        extension = getattr(parallel, "worker_extension_cls", "") or ""
        # vLLM sets ``model_executor`` on the engine only where the core runs in-process.
        in_process = hasattr(engine, "model_executor")
        pickles = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "").lower() in _TRUE
        if extension == EXTENSION:
            self._route = _Route("extension", in_process)
        elif in_process or pickles:
            self._route = _Route("function", in_process)
        else:
            raise WeightExportError(
                "vLLM's engine core runs in another process, and nothing reaches its worker "
                "without a pickled function, which it refuses: start the engine with "
                f'worker_extension_cls="{EXTENSION}" (no pickle), or with '
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1, or in this process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0); nothing was written"
            )
        return self._route

    def probe(self, path: str) -> tuple[str | None, str, str, int]:
        """The worker's answer to :func:`~shardkit.core.export.vllm_worker_load.probe_worker`."""
        found = self._call("shardkit_probe", probe_worker, (path,), "the probe of its worker")
        chosen, dtype, reason, pid = found  # a list after vLLM's RPC
        return chosen, dtype, reason, pid

    def load(self, path: str, payload: Any) -> None:
        """Load one bucket (tensors in this process, else safetensors bytes) by ``path``."""
        self._call("shardkit_load", load_on_worker, (path, payload), "a bucket's load")

    def stage(self, version: int, payload: Any) -> None:
        """Stage one bucket of export ``version`` on the worker (``vllm_versions.py``)."""
        self._call("shardkit_stage", stage_on_worker, (version, payload), "a bucket's staging")

    def commit(self, version: int, path: str, hold: bool = False) -> int:
        """Load export ``version``'s staged buckets in one call on the worker; its number.

        With ``hold`` the model as it was is kept on the worker until :meth:`settle`.
        """
        args = (version, path, hold) if hold else (version, path)
        done = self._call("shardkit_commit", commit_on_worker, args, "the commit")
        return int(done)

    def commit_files(self, version: int, path: str, load: list[Any], back: list[Any]) -> int:
        """Load export ``version`` from files in one call on the worker (``vllm_files.py``)."""
        args = (version, path, load, back)
        return int(self._call("shardkit_commit_files", commit_files_on_worker, args, "the commit"))

    def settle(self, keep: bool) -> int | None:
        """A held commit kept or undone on the worker; the version it then serves."""
        found = self._call("shardkit_settle", settle_held, (keep,), "the commit's settling")
        return None if found is None else int(found)

    def serving_version(self) -> int | None:
        """The export the engine's model holds complete (None: the weights it started with)."""
        found = self._call("shardkit_serving_version", serving_version, (), "its version")
        return None if found is None else int(found)

    def reset_prefix_cache(self) -> bool | None:
        """Forget the engine's prefix cache; what vLLM answers (None where it cannot)."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is None:
            return None
        if self.route().in_process:
            answer: bool | None = reset()
            return answer
        answered: bool | None = bounded(reset, "the reset of its prefix cache", self.bound_s)
        return answered

    def _call(
        self, name: str, function: Callable[..., Any], args: tuple[Any, ...], what: str
    ) -> Any:
        route = self.route()
        if route.how == "driver":
            worker = self.llm.llm_engine.model_executor.driver_worker
            return function(worker, *args)
        method: str | Callable[..., Any] = name if route.how == "extension" else function

        def rpc() -> Any:
            return self.llm.collective_rpc(method, args=args)[0]

        return rpc() if route.in_process else bounded(rpc, what, self.bound_s)
