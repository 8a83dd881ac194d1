"""How a TP-sliced export's driver reaches K vLLM workers elsewhere: a ``vllm.LLM``, or a server.

The driver (``vllm_slices_remote.py``) asks the engine's workers, by method name through
shardkit's worker extension, where they stand and then to serve one export. The same calls
reach them two ways:

- :class:`LLMDriver`: a ``vllm.LLM`` in the trainer's process whose engine core and workers
  run in processes of their own (the multiprocessing executor): ``collective_rpc`` by name,
  each call bounded on a helper thread (``vllm_rpc.bounded``); after the load, the prefix
  cache emptied;
- :class:`ServerDriver`: a ``vllm serve --tensor-parallel-size K``: ``POST /collective_rpc``
  (``vllm_server_calls.py``), its scheduling paused before the workers serve and resumed
  after, the prefix cache emptied first (as ``vllm_server.py`` does for one worker).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from shardkit.core.errors import WeightExportError
from shardkit.core.export.vllm_rpc import EngineCalls, bounded
from shardkit.core.export.vllm_server_calls import ServerCall, ServerCalls
from shardkit.core.export.vllm_worker import EXTENSION

__all__ = ["LLMDriver", "Serving", "ServerDriver", "SliceDriver"]

logger = logging.getLogger(__name__)

SERVE_METHOD = "shardkit_serve_slices"
"""The extension's method that serves one TP-sliced export on every worker."""


class Serving(Protocol):
    """The workers' serving call, started: every worker's answer, read later."""

    def answer(self, within_s: float) -> tuple[bool, Any] | None:
        """(ok, the workers' results or the error), or None where none came in time."""


class SliceDriver(Protocol):
    """The calls a driver makes into the engine, each bounded."""

    def rpc_all(self, method: str, args: list[Any], what: str) -> list[Any]:
        """Every worker's result of ``method(*args)``, by name."""

    def before_serving(self) -> None:
        """Checked and about to load: stop the engine's steps where it could take any."""

    def start_serving(self, args: list[Any]) -> Serving:
        """Ask every worker to serve one export (``shardkit_serve_slices(*args)``)."""

    def after_load(self) -> None:
        """Every worker loaded: empty the prefix cache (and resume a server)."""

    def after_failure(self) -> None:
        """The export failed: let the engine step again (its weights may be a mix)."""


class _Pending:
    """One call on a helper thread: started now, its answer read later (bounded)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                self.outcome.append((True, call()))
            except BaseException as error:  # handed to the caller's thread
                self.outcome.append((False, error))

        self.thread = threading.Thread(target=run, name="shardkit-slices-serve", daemon=True)
        self.thread.start()

    def answer(self, within_s: float) -> tuple[bool, Any] | None:
        self.thread.join(within_s)
        return self.outcome[0] if self.outcome else None


class LLMDriver:
    """A ``vllm.LLM`` whose workers run elsewhere, started with ``worker_extension_cls``."""

    def __init__(self, llm: Any, bound_s: float) -> None:
        self.llm, self.bound_s = llm, bound_s
        self.calls = EngineCalls(llm, bound_s)

    def rpc_all(self, method: str, args: list[Any], what: str) -> list[Any]:
        """``collective_rpc`` by name (an engine without the extension refused by name)."""
        if self.calls.route().how != "extension":
            raise WeightExportError(
                "a TP-sliced export into workers of their own reaches them by method name: "
                f'start the engine with worker_extension_cls="{EXTENSION}"; nothing was written'
            )
        llm = self.llm

        def call() -> list[Any]:
            found: list[Any] = llm.collective_rpc(method, args=tuple(args))
            return found

        return bounded(call, what, self.bound_s)

    def before_serving(self) -> None:
        """Nothing: the engine core steps for this process's calls alone, none meanwhile."""

    def start_serving(self, args: list[Any]) -> Serving:
        """The serving call, on a helper thread."""
        llm = self.llm
        return _Pending(lambda: llm.collective_rpc(SERVE_METHOD, args=tuple(args)))

    def after_load(self) -> None:
        """The prefix cache emptied (a warning where vLLM says it did not)."""
        if self.calls.reset_prefix_cache() is False:
            logger.warning("vLLM did not reset its prefix cache after the weight update")

    def after_failure(self) -> None:
        """Nothing to resume."""


class _ServerServing:
    """The server's answer to the serving call: the workers' results, from its JSON."""

    def __init__(self, call: ServerCall) -> None:
        self.call = call

    def answer(self, within_s: float) -> tuple[bool, Any] | None:
        found = self.call.answer(within_s)
        if found is None or not found[0]:
            return found
        try:
            return True, json.loads(found[1])["results"]
        except (ValueError, KeyError, TypeError) as error:
            return False, error


class ServerDriver:
    """A ``vllm serve`` of ``--tensor-parallel-size K`` at ``url`` (see ``vllm_server.py``)."""

    def __init__(self, url: str, bound_s: float) -> None:
        self.calls = ServerCalls(url, bound_s)

    def rpc_all(self, method: str, args: list[Any], what: str) -> list[Any]:
        """``POST /collective_rpc`` by name."""
        return self.calls.rpc_all(method, args, what)

    def before_serving(self) -> None:
        """Pause the scheduling (its requests in flight finish first), bounded."""
        self.calls.pause()
        self.calls.loading = True

    def start_serving(self, args: list[Any]) -> Serving:
        """The serving call's request, on a helper thread."""
        return _ServerServing(self.calls.start_rpc(SERVE_METHOD, args))

    def after_load(self) -> None:
        """The prefix cache emptied, checked, then the scheduling resumed."""
        self.calls.resume()

    def after_failure(self) -> None:
        """The scheduling resumed (the cache emptied first); a failure here only logged."""
        try:
            self.calls.resume()
        except WeightExportError as failed:  # the export's own error is the one raised
            logger.warning("after a failed TP-sliced export: %s", failed)
