"""The vLLM tests run only where vLLM imports (``make check-vllm``'s .venv-vllm).

Elsewhere (the default run) they are not collected at all, rather than reported skipped: vLLM
is an optional set of its own, not a missing dependency of the default run.

Where vLLM is present, the engines run in this process (the colocated mode the receiver is
for), with a small KV cache. After each test file, the ``multiprocessing`` shared-memory
segments it left behind that no process maps are removed: vLLM's message queues of engines
killed or ended with their processes (``make check-vllm`` of 2026-11-30 left two groups of
four, 24 to 240 MiB each, 664 MiB a group, by their sizes vLLM's ``ShmRingBuffer``s; the
files that left them did not leave them again when run alone).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

try:
    importlib.import_module("vllm")
except ImportError:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True, scope="module")
def _no_orphaned_ring_buffers() -> Iterator[None]:
    from tests.vllm import servers

    before = servers.segments(servers.RING_BUFFERS)
    yield
    servers.remove_orphaned_segments(before, servers.RING_BUFFERS)
