"""The vLLM tests run only where vLLM imports (``make check-vllm``'s .venv-vllm).

Elsewhere (the default run) they are not collected at all, rather than reported skipped: vLLM
is an optional set of its own, not a missing dependency of the default run.

Where vLLM is present, the engines run in this process (the colocated mode the receiver is
for), with a small KV cache.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

try:
    importlib.import_module("vllm")
except ImportError:
    collect_ignore_glob = ["test_*.py"]
