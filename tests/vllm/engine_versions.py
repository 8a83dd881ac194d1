"""A vLLM engine in a process of its own, taking exports through shared memory, that records
what it serves after every export's end (tests/vllm/test_version_kills.py).

Usage (the authkey in ``SHARDKIT_TEST_AUTHKEY``)::

    python -m tests.vllm.engine_versions FOLDER ADDRESS OUT [files]

It starts vLLM's engine on ``FOLDER``'s model (its core in this process), serves exports from
a ``SharedMemorySender`` at ``ADDRESS`` into a ``VLLMReceiver`` (all or nothing: staged, then
committed in one call on the worker; with ``files``, its mirror under ``OUT/mirror`` and each
export loaded from files at the commit), and after every export that finished or was aborted
(its sender killed, the trainer's verdict) writes what the engine serves, read back tensor by
tensor through its kernels (``served_weights.py``), to ``OUT/served_<n>.safetensors``, then a
line ``{"n", "outcome", "export", "version"}`` to ``OUT/events.jsonl``. ``OUT/ready`` once it
listens.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from safetensors.torch import save_file

from shardkit.core.export.messages import ExportManifest
from shardkit.core.export.shared_memory import serve_shared_memory
from shardkit.core.export.vllm import VLLMReceiver
from tests.vllm.engines import start_engine
from tests.vllm.served_weights import served_weights

AUTHKEY_ENV = "SHARDKIT_TEST_AUTHKEY"


class RecordingReceiver(VLLMReceiver):
    """A ``VLLMReceiver`` that writes what the engine serves after each export's end."""

    def __init__(self, llm: Any, out: Path, *, in_files: bool) -> None:
        super().__init__(llm, bound_s=60, mirror_dir=out / "mirror" if in_files else None)
        self.out = out
        self.events = 0
        self.current: ExportManifest | None = None

    def begin(self, manifest: ExportManifest) -> None:
        self.current = manifest
        super().begin(manifest)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._record("finished")

    def abort(self, error: BaseException) -> None:
        super().abort(error)
        self._record(f"aborted: {error}")

    def _record(self, outcome: str) -> None:
        self.events += 1
        served = served_weights(self.llm, torch.bfloat16)
        save_file(served, str(self.out / f"served_{self.events}.safetensors"))
        event = {
            "n": self.events,
            "outcome": outcome,
            "export": None if self.current is None else self.current.export_id,
            "version": self.serving_version(),
        }
        with (self.out / "events.jsonl").open("a") as log:
            log.write(json.dumps(event) + "\n")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="engine: %(message)s")
    folder, address, out = Path(argv[0]), argv[1], Path(argv[2])
    in_files = argv[3:] == ["files"]
    receiver = RecordingReceiver(start_engine(folder), out, in_files=in_files)
    authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
    serve_shared_memory(address, authkey, receiver, ready=lambda: (out / "ready").touch())


if __name__ == "__main__":
    main(sys.argv[1:])
