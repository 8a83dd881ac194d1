"""The trainer's ranks of tests/vllm/test_vllm_server.py (run through harness.pool at W=2).

Each rank loads the tiny Qwen2 in fp32, shards it per decoder layer and at the root, and
exports to a ``vllm serve`` through :class:`~shardkit.core.export.vllm_server.
VLLMServerReceiver` on rank 0. Nothing here imports vLLM: the trainer reaches the server by
HTTP and shared memory only.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from shardkit.core import fully_shard
from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportOptions, WeightExporter
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.vllm_server import VLLMServerReceiver
from tests.vllm import engines, servers

DTYPE = torch.bfloat16
STEPS = ((1e-3, True), (1e-6, True))  # (learning rate, delta): the first delta export is full
"""The first step moves the greedy outputs; the second is small enough for a delta."""


def sharded_model(folder: Path) -> torch.nn.Module:
    """The checkpoint at ``folder`` in fp32, ``fully_shard`` per decoder layer and at the root."""
    transformers = importlib.import_module("transformers")
    model = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded: torch.nn.Module = model
    return sharded


def train_and_sync(
    rank: int, world_size: int, *, folder: str, url: str, out: str, bound_s: float
) -> list[dict[str, Any]]:
    """One AdamW step and one export per entry of STEPS; after each, rank 0 saves the trainer's
    weights (``out/step<k>``, for a fresh server) and asks the synced server for completions.
    """
    model = sharded_model(Path(folder))
    optimizer = torch.optim.AdamW(model.parameters(), lr=STEPS[0][0])
    exporter = WeightExporter(model, ExportOptions(dtype=DTYPE, bound_s=bound_s))
    receiver = VLLMServerReceiver(url, bound_s=bound_s) if exporter.receiving else None
    generator = torch.Generator().manual_seed(rank)
    rounds = []
    for step, (lr, delta) in enumerate(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = torch.randint(0, servers.VOCAB, (4, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = exporter.export(receiver, delta=delta)
        full = {name: t.full_tensor().to(DTYPE) for name, t in model.state_dict().items()}
        found: dict[str, Any] = {
            "kind": report.kind,
            "plain_buckets": report.counts.plain_buckets,
            "sent_bytes": report.counts.sent_bytes,
            "seconds": report.seconds,
        }
        if rank == 0:
            saved = Path(out) / f"step{step}"
            engines.save_weights_beside(Path(folder), saved, full)
            found["saved"] = str(saved)
            found["completions"] = servers.completions(url, Path(folder))
        rounds.append(found)
    return rounds


class _KillsAfterBegin:
    """Rank 0's receiver that kills process ``pid`` once the manifest is sent (mid-export)."""

    def __init__(self, inner: VLLMServerReceiver, pid: int) -> None:
        self.inner, self.pid = inner, pid

    def begin(self, manifest: ExportManifest) -> None:
        self.inner.begin(manifest)
        os.kill(self.pid, signal.SIGKILL)

    def receive(self, bucket: WeightBucket) -> None:
        self.inner.receive(bucket)

    def commit(self) -> None:
        self.inner.commit()

    def finish(self) -> None:
        self.inner.finish()

    def abort(self, error: BaseException) -> None:
        self.inner.abort(error)


def export_into_a_dying_server(
    rank: int, world_size: int, *, folder: str, url: str, kill_pid: int, bound_s: float
) -> dict[str, Any]:
    """A full export during which rank 0 kills ``kill_pid`` (0: none, the server is already
    dead): this rank's error and seconds."""
    model = sharded_model(Path(folder))
    exporter = WeightExporter(model, ExportOptions(dtype=DTYPE, bound_s=bound_s))
    receiver: Any = None
    if exporter.receiving:
        receiver = VLLMServerReceiver(url, bound_s=bound_s)
        if kill_pid:
            receiver = _KillsAfterBegin(receiver, kill_pid)
    start = time.monotonic()
    try:
        exporter.export(receiver)
    except WeightExportError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}
