"""A stand-in for ``vllm serve``'s HTTP endpoints (no vLLM): each request answered by a
function of its path and JSON body, and recorded."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Answer", "StandInServer"]

Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]


class StandInServer:
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
