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
import threading
import time
from pathlib import Path
from typing import Any

import torch

from shardkit.core import fully_shard
from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportOptions, WeightExporter
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.vllm_read_back import tensor_digest
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


class _AfterBegin:
    """Rank 0's receiver: the server's, with something done once the manifest is sent."""

    def __init__(self, inner: VLLMServerReceiver) -> None:
        self.inner = inner

    def begin(self, manifest: ExportManifest) -> None:
        self.inner.begin(manifest)
        self.after_begin()

    def after_begin(self) -> None:
        raise NotImplementedError

    def receive(self, bucket: WeightBucket) -> None:
        self.inner.receive(bucket)

    def commit(self) -> None:
        self.inner.commit()

    def finish(self) -> None:
        self.inner.finish()

    def abort(self, error: BaseException) -> None:
        self.inner.abort(error)


class _AsksDuringExport(_AfterBegin):
    """Rank 0's receiver that requests :data:`servers.LONG_PROMPT`'s completion while the
    export is under way, and keeps what the server answered.

    The server answered that prompt before the export, so its prefix cache holds the first
    block's keys and values computed by the old weights. The request is sent once the export
    began, and a second later the first bucket goes: the request waits in the server while the
    worker loads. Where the server could schedule it before its prefix cache is emptied, it
    would reuse that block with the new weights, and its answer would differ from a fresh
    server's on them.
    """

    def __init__(self, inner: VLLMServerReceiver, folder: Path) -> None:
        super().__init__(inner)
        self.folder = folder
        self.answers: list[dict[str, Any]] = []
        self._asking: threading.Thread | None = None

    def after_begin(self) -> None:
        ask = servers.completions
        args = (self.inner.url, self.folder, [servers.LONG_PROMPT])
        self._asking = threading.Thread(target=lambda: self.answers.extend(ask(*args)))
        self._asking.start()
        time.sleep(1.0)  # the request reaches the engine before the first bucket

    def answered(self) -> dict[str, Any]:
        """The completion asked for during the export (it comes once the export ended)."""
        assert self._asking is not None
        self._asking.join(120)
        assert len(self.answers) == 1, self.answers
        return self.answers.pop()


def read_back_against(
    receiver: VLLMServerReceiver, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Every tensor the server computes with, read back by digest, against the trainer's
    ``full`` (each cast to the dtype the engine keeps it in, as the engine cast it)."""
    served = receiver.weight_digests()
    differ = sorted(set(served) ^ set(full))
    for name in sorted(set(served) & set(full)):
        dtype = getattr(torch, served[name][0])
        if tensor_digest(full[name].to(dtype)) != served[name]:
            differ.append(name)
    return {"tensors": len(served), "differ": differ}


def train_and_sync(
    rank: int, world_size: int, *, folder: str, url: str, out: str, bound_s: float
) -> list[dict[str, Any]]:
    """One AdamW step and one export per entry of STEPS; after each, rank 0 saves the trainer's
    weights (``out/step<k>``, for a fresh server), reads every tensor back from the server
    against them, and asks the synced server for completions; ``during`` is the completion
    requested while the export ran (:class:`_AsksDuringExport`).
    """
    model = sharded_model(Path(folder))
    optimizer = torch.optim.AdamW(model.parameters(), lr=STEPS[0][0])
    exporter = WeightExporter(model, ExportOptions(dtype=DTYPE, bound_s=bound_s))
    server = VLLMServerReceiver(url, bound_s=bound_s)
    receiver = _AsksDuringExport(server, Path(folder)) if exporter.receiving else None
    if receiver is not None:  # the old weights' prefix, cached
        servers.completions(url, Path(folder), [servers.LONG_PROMPT])
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
        if receiver is not None:
            saved = Path(out) / f"step{step}"
            engines.save_weights_beside(Path(folder), saved, full)
            found["saved"] = str(saved)
            found["during"] = receiver.answered()
            found["read_back"] = read_back_against(server, full)
            found["completions"] = servers.completions(url, Path(folder))
        rounds.append(found)
    return rounds


class _KillsAfterBegin(_AfterBegin):
    """Rank 0's receiver that kills process ``pid`` once the manifest is sent (mid-export)."""

    def __init__(self, inner: VLLMServerReceiver, pid: int) -> None:
        super().__init__(inner)
        self.pid = pid

    def after_begin(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


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
