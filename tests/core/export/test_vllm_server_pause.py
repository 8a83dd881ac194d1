"""``VLLMServerReceiver``'s pause around an export, against a stand-in HTTP server (no vLLM).

The receiver pauses a ``vllm serve``'s scheduling before the worker loads and resumes it only
after the prefix cache is emptied (tests/vllm/test_vllm_server.py shows it on vLLM's own
server). Here, what no real server of this repository shows: a vLLM without ``/pause`` and a
server paused by another client are refused in ``begin`` by name, before the worker is asked
to serve; a pause that does not come within the bound (requests in flight that never finish)
ends ``begin`` within the bound, and the exporter's ``abort`` resumes the server.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportedTensor, ExportManifest
from shardkit.core.export.vllm_server import VLLMServerReceiver

BOUND_S = 1.0
MANIFEST = ExportManifest(
    export_id=0,
    kind="full",
    tensors=(ExportedTensor("w", (2, 2), torch.bfloat16, 0),),
    bucket_count=1,
)
Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]


class _Server:
    """A stand-in for ``vllm serve``'s endpoints: ``answer(path, body)`` gives (status, JSON);
    every request is recorded as ``(path, body)``."""

    def __init__(self, answer: Answer) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer({})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"{}"))

            def _answer(self, body: dict[str, Any]) -> None:
                outer.seen.append((self.path, body))
                status, content = answer(self.path, body)
                data = json.dumps(content).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the receiver gave up waiting: its bound
                    self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        serve = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        serve.start()

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]

    def served(self) -> bool:
        """Whether the worker was asked to serve an export."""
        return any(body.get("method") == "shardkit_serve_export" for _, body in self.seen)


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], _Server]]:
    started: list[_Server] = []

    def start(answer: Answer) -> _Server:
        started.append(_Server(answer))
        return started[-1]

    yield start
    for server in started:
        server.httpd.shutdown()
        server.httpd.server_close()


def _vllm(*, paused: bool = False, pause_s: float = 0.0, has_pause: bool = True) -> Answer:
    """A server whose worker takes weights; ``/pause`` answers after ``pause_s``."""

    def answer(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/collective_rpc" and body.get("method") == "shardkit_probe":
            return 200, {"results": [["reload", "bfloat16", "", 1]]}
        if not has_pause and path.split("?")[0] in ("/is_paused", "/pause", "/resume"):
            return 404, {"detail": "Not Found"}
        if path == "/is_paused":
            return 200, {"is_paused": paused}
        if path.startswith("/pause"):
            time.sleep(pause_s)
            return 200, {"status": "paused"}
        if path == "/resume":
            return 200, {"status": "resumed"}
        return 500, {"error": f"not in this stand-in: {path}"}

    return answer


def test_a_vllm_without_pause_is_refused_in_begin_by_name(
    serve: Callable[[Answer], _Server],
) -> None:
    server = serve(_vllm(has_pause=False))
    receiver = VLLMServerReceiver(server.url, bound_s=BOUND_S)
    with pytest.raises(WeightExportError, match=r"/is_paused.*/pause, /resume"):
        receiver.begin(MANIFEST)
    receiver.abort(RuntimeError("as the exporter does"))
    assert not server.served() and server.paths() == ["/collective_rpc", "/is_paused"]


def test_a_server_paused_by_another_client_is_refused_and_left_paused(
    serve: Callable[[Answer], _Server],
) -> None:
    server = serve(_vllm(paused=True))
    receiver = VLLMServerReceiver(server.url, bound_s=BOUND_S)
    with pytest.raises(WeightExportError, match="is paused already"):
        receiver.begin(MANIFEST)
    receiver.abort(RuntimeError("as the exporter does"))
    assert not server.served() and "/resume" not in server.paths()


def test_a_pause_that_does_not_come_within_the_bound_ends_begin_and_abort_resumes(
    serve: Callable[[Answer], _Server],
) -> None:
    server = serve(_vllm(pause_s=BOUND_S + 2))  # requests in flight that do not finish
    receiver = VLLMServerReceiver(server.url, bound_s=BOUND_S)
    start = time.monotonic()
    with pytest.raises(WeightExportError, match=r"pause of its scheduling.*within 1 s"):
        receiver.begin(MANIFEST)
    assert time.monotonic() - start < BOUND_S + 1.5
    receiver.abort(RuntimeError("as the exporter does"))
    # No load was asked for: the scheduling is resumed, no reset of the cache needed.
    assert not server.served() and server.paths()[-1] == "/resume"
    assert "/reset_prefix_cache" not in server.paths()
