"""A ``vllm serve``'s endpoints as an export calls them: each request bounded, refusals named.

Both receivers that drive a server (``vllm_server.py``: one worker; ``vllm_slices_remote.py``:
K tensor-parallel workers, each taking its windows) reach its workers through
``POST /collective_rpc`` (the server started with ``VLLM_SERVER_DEV_MODE=1`` and shardkit's
worker extension: methods by name, no pickled function) and pause its scheduling around the
load (``/pause?mode=wait``, then ``/reset_prefix_cache``, checked, then ``/resume``), so no
request is computed on a prefix the old weights cached (see ``vllm_server.py``). Every request
waits at most the bound and fails as a :class:`~shardkit.core.errors.WeightExportError`
naming the endpoint and, where the answer tells, the setting the server lacks. The one call
that may outlast the bound (the workers serving an export) runs on a helper thread
(:class:`ServerCall`) and is answered later, bounded there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from shardkit.core.errors import WeightExportError
from shardkit.core.export.vllm_worker import EXTENSION

__all__ = ["ServerCall", "ServerCalls"]

logger = logging.getLogger(__name__)


class ServerCall:
    """One HTTP request on a helper thread: started now, its answer read later."""

    def __init__(self, request: urllib.request.Request) -> None:
        self.outcome: list[tuple[bool, Any]] = []
        self.thread = threading.Thread(
            target=self._run, args=(request,), name="shardkit-server-call", daemon=True
        )
        self.thread.start()

    def _run(self, request: urllib.request.Request) -> None:
        try:
            with urllib.request.urlopen(request) as response:  # no timeout: see ``answer``
                self.outcome.append((True, response.read()))
        except BaseException as error:  # handed to the caller's thread
            self.outcome.append((False, error))

    def answer(self, within_s: float) -> tuple[bool, Any] | None:
        """(ok, the body or the error), or None where it did not come within ``within_s``."""
        self.thread.join(within_s)
        return self.outcome[0] if self.outcome else None


class ServerCalls:
    """The requests one receiver makes to the server at ``url``, each within ``bound_s``."""

    def __init__(self, url: str, bound_s: float) -> None:
        self.url = url.rstrip("/")
        self.bound_s = bound_s
        self.paused = False
        """This receiver paused the scheduling and has not resumed it."""
        self.loading = False
        """The workers may have loaded: the resume empties the prefix cache first."""

    def rpc_all(self, method: str, args: list[Any], what: str) -> list[Any]:
        """Every worker's result of ``method(*args)`` through ``/collective_rpc``."""
        body = {"method": method, "args": args, "timeout": self.bound_s}
        results = self.field(self.http("/collective_rpc", body, what), "results", what)
        if not isinstance(results, list) or not results:
            raise WeightExportError(f"the vLLM server at {self.url} gave no result to {what}")
        return results

    def start_rpc(self, method: str, args: list[Any]) -> ServerCall:
        """``method(*args)`` on every worker, on a helper thread (see :class:`ServerCall`)."""
        return ServerCall(self.request("/collective_rpc", {"method": method, "args": args}))

    def pause(self) -> None:
        """Stop the server's scheduling once its requests in flight finished (bounded)."""
        what = "whether it is paused"
        paused = self.field(self.http("/is_paused", None, what, method="GET"), "is_paused", what)
        if paused and self.paused:
            return  # still paused by this receiver, after a reset that failed
        if paused:
            raise WeightExportError(
                f"the vLLM server at {self.url} is paused already (POST /pause by another "
                "client): resume it first; the export pauses it itself, and resumes it"
            )
        self.paused = True  # before the call: a pause that times out may still come
        what = "the pause of its scheduling (its requests in flight finish first)"
        self.http("/pause?mode=wait", None, what)

    def resume(self) -> None:
        """Resume the scheduling this receiver paused.

        Where the workers may have loaded new weights, the prefix cache is emptied first, and
        the scheduling resumed only where that succeeded.
        """
        if not self.paused:
            return
        if self.loading:
            what = "the reset of its prefix cache"
            answer = self.http("/reset_prefix_cache", None, what)
            if self.field(answer, "success", what) is not True:
                raise WeightExportError(
                    f"the vLLM server at {self.url} did not empty its prefix cache after the "
                    f"weights changed (it answered {answer[:200]!r}): it stays paused, so that "
                    "no request reuses the old weights' prefixes; the next export resumes it"
                )
            self.loading = False
        self.http("/resume", None, "the resume of its scheduling")
        self.paused = False

    def explained(self, error: WeightExportError, call: ServerCall) -> WeightExportError:
        """``error``, with the server's own answer to ``call`` where that failed."""
        answer = call.answer(0.0)
        if answer is None or answer[0]:
            return error
        return WeightExportError(f"{error}; the server answered: {http_text(answer[1])}")

    def field(self, answer: bytes, key: str, what: str) -> Any:
        """``key`` of the server's JSON ``answer`` to ``what``."""
        try:
            return json.loads(answer)[key]
        except (ValueError, KeyError, TypeError) as error:
            raise WeightExportError(
                f"the vLLM server at {self.url} gave a malformed answer to {what}: {answer[:200]!r}"
            ) from error

    def http(
        self, path: str, body: dict[str, Any] | None, what: str, *, method: str = "POST"
    ) -> bytes:
        """The server's answer to one request, within the bound, or a WeightExportError."""
        try:
            with urllib.request.urlopen(
                self.request(path, body, method), timeout=self.bound_s
            ) as response:
                answer: bytes = response.read()
                return answer
        except urllib.error.HTTPError as error:
            raise WeightExportError(
                f"the vLLM server at {self.url} refused {what} ({path}): {http_text(error)}"
                + _missing_setting(error, path)
            ) from error
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
            raise WeightExportError(
                f"the vLLM server at {self.url} did not answer {what} within {self.bound_s:g} s "
                f"(SHARDKIT_EXPORT_BOUND): {error}"
            ) from error

    def request(
        self, path: str, body: dict[str, Any] | None, method: str = "POST"
    ) -> urllib.request.Request:
        """One request to the server (a JSON body, none for GET)."""
        data = None if method == "GET" else json.dumps(body if body is not None else {}).encode()
        headers = {"Content-Type": "application/json"}
        return urllib.request.Request(self.url + path, data=data, headers=headers, method=method)


def http_text(error: object) -> str:
    """What a failed request said (an HTTP error's status and body, else the error)."""
    if isinstance(error, urllib.error.HTTPError):
        with contextlib.suppress(OSError):
            return f"HTTP {error.code}: {error.read()[:500].decode(errors='replace')}"
        return f"HTTP {error.code}"
    return f"{type(error).__name__}: {error}"


def _missing_setting(error: urllib.error.HTTPError, path: str) -> str:
    """What the server was started without, where its answer tells."""
    if error.code == 404 and path != "/collective_rpc":  # the probe went through: dev mode is on
        return (
            f"; this vLLM has no {path} (vLLM 0.32's development endpoints have /pause, "
            "/resume and /is_paused): the export pauses the server's scheduling around the "
            "load, so that no prefix cached under the old weights is reused"
        )
    if error.code == 404:
        return f"; start the server with VLLM_SERVER_DEV_MODE=1 (it has no {path} without)"
    if path == "/collective_rpc":
        return f"; start the server with --worker-extension-cls {EXTENSION}"
    return ""
