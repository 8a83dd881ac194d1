"""``VLLMServerReceiver``'s pause around an export, against a stand-in HTTP server (no vLLM).

The receiver pauses a ``vllm serve``'s scheduling before the worker loads and resumes it only
after the prefix cache is emptied (tests/vllm/test_vllm_server.py shows it on vLLM's own
server). Here, what no real server of this repository shows: a vLLM without ``/pause`` and a
server paused by another client are refused in ``begin`` by name, before the worker is asked
to serve; a pause that does not come within the bound (requests in flight that never finish)
ends ``begin`` within the bound, and the exporter's ``abort`` resumes the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportedTensor, ExportManifest
from shardkit.core.export.vllm_server import VLLMServerReceiver
from tests.core.export.stand_in_server import Answer, StandInServer

BOUND_S = 1.0
MANIFEST = ExportManifest(
    export_id=0,
    kind="full",
    tensors=(ExportedTensor("w", (2, 2), torch.bfloat16, 0),),
    bucket_count=1,
)


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], StandInServer]]:
    started: list[StandInServer] = []

    def start(answer: Answer) -> StandInServer:
        started.append(StandInServer(answer))
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
    serve: Callable[[Answer], StandInServer],
) -> None:
    server = serve(_vllm(has_pause=False))
    receiver = VLLMServerReceiver(server.url, bound_s=BOUND_S)
    with pytest.raises(WeightExportError, match=r"/is_paused.*/pause, /resume"):
        receiver.begin(MANIFEST)
    receiver.abort(RuntimeError("as the exporter does"))
    assert not server.served() and server.paths() == ["/collective_rpc", "/is_paused"]


def test_a_server_paused_by_another_client_is_refused_and_left_paused(
    serve: Callable[[Answer], StandInServer],
) -> None:
    server = serve(_vllm(paused=True))
    receiver = VLLMServerReceiver(server.url, bound_s=BOUND_S)
    with pytest.raises(WeightExportError, match="is paused already"):
        receiver.begin(MANIFEST)
    receiver.abort(RuntimeError("as the exporter does"))
    assert not server.served() and "/resume" not in server.paths()


def test_a_pause_that_does_not_come_within_the_bound_ends_begin_and_abort_resumes(
    serve: Callable[[Answer], StandInServer],
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
