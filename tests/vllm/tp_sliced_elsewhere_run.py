"""A TP-sliced export at W=2 into a vLLM engine of TP degree 2 whose workers run elsewhere.

Run with torchrun (2 ranks) by ``test_tp_sliced_elsewhere.py``. Rank 0 holds the engine's
``vllm.LLM``: vLLM's multiprocessing executor, its engine core and its two workers each in a
process of its own, started with shardkit's worker extension. Each trainer rank (a tiny Qwen2,
``fully_shard`` per decoder layer and at the root) sends its engine rank's windows to that
rank's worker through shared memory (``VLLMRemoteSliceReceiver``).

Three syncs into an engine started from other weights: the trainer's weights T1; then moved
(T2); then T1 again (the trainer's shards put back). After the first and the third, the
engine's greedy tokens, top-5 log-probabilities and every parameter of each engine rank (read
back on its worker as digests) must equal a fresh TP=2 engine's started from T1. Then moved
weights whose export rank 1 refuses after every worker loaded them: the engine must serve T1
again, complete (every worker's load undone). Rank 0 writes ``result.json`` into ``--out``.

With ``--one-engine`` (torchrun at W=4: more trainer ranks than engine ranks), the exporter is
``SlicedExporter(one_engine=True)``: trainer ranks 0 and 1 take engine ranks 0 and 1's windows,
ranks 2 and 3 only send; the same three syncs, against the same fresh engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from demo.grpo_vllm import start_engine

from shardkit.core.errors import WeightExportError
from shardkit.core.export.tp_export import SlicedExporter
from shardkit.core.export.tp_slices import EngineTP
from shardkit.core.export.vllm_slices_remote import VLLMRemoteSliceReceiver, remote_slice_receiver
from shardkit.core.export.vllm_worker import EXTENSION
from tests.vllm.tp_sliced_run import DTYPE, greedy, sharded_trainer

BOUND_S = 60.0
KILL_BOUND_S = 20.0


def engine(folder: Path) -> Any:
    """A TP=2 engine on ``folder``: the multiprocessing executor, shardkit's extension."""
    return start_engine(
        folder,
        seed=0,
        shares_the_group=False,
        max_num_seqs=4,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        worker_extension_cls=EXTENSION,
    )


def observe(llm: Any) -> dict[str, Any]:
    """What the engine serves: greedy outputs, and each engine rank's parameter digests."""
    digests = llm.collective_rpc("shardkit_partition_digests")
    return {"outputs": greedy(llm), "digests": digests}


def shared_key() -> bytes:
    """Rank 0's random key on every rank (the launcher's secret, as a user would share it)."""
    key = torch.randint(0, 256, (32,), dtype=torch.uint8)
    dist.broadcast(key, src=0)
    return bytes(key.tolist())


def run(out: Path, rank: int) -> dict[str, Any]:
    tp, model, first = sharded_trainer(out, rank)
    key = shared_key()
    llm = engine(out / "initial") if rank == 0 else None
    dist.barrier()
    found: dict[str, Any] = {"rank": rank}
    if llm is not None:
        found["before"] = observe(llm)
    exporter = SlicedExporter(model, tp, dtype=DTYPE, bucket_bytes=2**20, bound_s=BOUND_S)
    receiver = remote_slice_receiver(exporter, authkey=key, llm=llm)
    assert receiver is not None  # W = K: every rank takes an engine rank's windows
    reports = [exporter.export(receiver)]
    if llm is not None:
        found["served"] = [receiver.served]
        found["first"] = observe(llm)
    kept = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.full_like(param, 0.01))
    reports.append(exporter.export(receiver))
    if llm is not None:
        found["served"].append(receiver.served)
        found["moved"] = observe(llm)
    with torch.no_grad():
        for param, was in zip(model.parameters(), kept, strict=True):
            param.copy_(was)
    reports.append(exporter.export(receiver))
    if llm is not None:
        found["served"].append(receiver.served)
        found["again"] = observe(llm)
    found["reports"] = [
        {
            "window_bytes": r.window_bytes,
            "received_bytes": r.received_bytes,
            "copied_bytes": r.copied_bytes,
            "sent_bytes": r.sent_bytes,
            "seconds": r.seconds,
            "handoff_seconds": r.handoff_seconds,
        }
        for r in reports
    ]
    found["model_bytes"] = sum(t.numel() * t.element_size() for t in first.values())
    found["failure"] = failing_export(model, tp, key, llm)
    if llm is not None:
        found["after_failure"] = observe(llm)
    found["refused_after_load"] = refused_after_load(exporter, key, llm, model, rank)
    if llm is not None:
        found["after_refusal"] = observe(llm)
    found["killed"] = export_after_a_kill(exporter, key, llm)
    if llm is not None:
        with contextlib.suppress(Exception):  # its worker is dead: the engine may be too
            llm.llm_engine.engine_core.shutdown()
        del llm
        found["fresh"] = observe_fresh(out)
    return found


def observe_fresh(out: Path) -> dict[str, Any]:
    """What a fresh TP=2 engine started from the trainer's weights serves (the oracle)."""
    fresh = engine(out / "trained")
    found = observe(fresh)
    fresh.llm_engine.engine_core.shutdown()
    return found


def run_one_engine(out: Path, rank: int) -> dict[str, Any]:
    """W=4 into the TP=2 engine: the first two ranks receive, the others only send."""
    tp, model, first = sharded_trainer(out, rank)
    key = shared_key()
    llm = engine(out / "initial") if rank == 0 else None
    dist.barrier()
    found: dict[str, Any] = {"rank": rank, "served": []}
    if llm is not None:
        found["before"] = observe(llm)
    exporter = SlicedExporter(
        model, tp, dtype=DTYPE, bucket_bytes=2**20, bound_s=BOUND_S, one_engine=True
    )
    receiver = remote_slice_receiver(exporter, authkey=key, llm=llm)
    found["receives"] = receiver is not None
    kept = [p.detach().clone() for p in model.parameters()]
    reports = []
    for sync, shift in (("first", None), ("moved", 0.01), ("again", None)):
        with torch.no_grad():
            for param, was in zip(model.parameters(), kept, strict=True):
                param.copy_(was if shift is None else was + shift)
        reports.append(exporter.export(receiver))
        if llm is not None:
            assert receiver is not None
            found["served"].append(receiver.served)
            found[sync] = observe(llm)
    found["reports"] = [
        {"window_bytes": r.window_bytes, "received_bytes": r.received_bytes,
         "copied_bytes": r.copied_bytes, "sent_bytes": r.sent_bytes}
        for r in reports
    ]  # fmt: skip
    found["model_bytes"] = sum(t.numel() * t.element_size() for t in first.values())
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        found["fresh"] = observe_fresh(out)
    return found


def failing_export(model: torch.nn.Module, tp: EngineTP, key: bytes, llm: Any) -> dict[str, Any]:
    """An export in float32 into the bf16 engine: one error on every rank, within the bound.

    The driver refuses it before any byte (its probe's dtypes); the other rank, connecting to
    a worker that was never asked to serve, learns it from the exporter's verdict.
    """
    exporter = SlicedExporter(model, tp, dtype=torch.float32, bucket_bytes=2**20, bound_s=20.0)
    return timed_error(exporter, remote_slice_receiver(exporter, authkey=key, llm=llm))


class _RefusingAfterLoad(VLLMRemoteSliceReceiver):
    """Rank 1's receiver: its commit raises once its worker loaded the export (held there)."""

    def commit(self) -> None:
        super().commit()
        raise RuntimeError("rank 1 refused the export after its worker loaded it (injected)")


def refused_after_load(
    exporter: SlicedExporter, key: bytes, llm: Any, model: torch.nn.Module, rank: int
) -> dict[str, Any]:
    """Moved weights exported, every worker loads them, then rank 1 refuses: all or nothing,
    the driver undoes every worker's load and the engine serves the last export, complete."""
    kept = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.full_like(param, 0.01))
    receiver = (
        _RefusingAfterLoad(exporter.engine, 1, authkey=key, bound_s=exporter.bound_s)
        if rank == 1
        else remote_slice_receiver(exporter, authkey=key, llm=llm)
    )
    found = timed_error(exporter, receiver)
    with torch.no_grad():
        for param, was in zip(model.parameters(), kept, strict=True):
            param.copy_(was)
    return found


def export_after_a_kill(exporter: SlicedExporter, key: bytes, llm: Any) -> dict[str, Any]:
    """Engine rank 1's worker killed, then an export: one error on every rank, bounded."""
    if llm is not None:
        pid = llm.collective_rpc("shardkit_probe", args=("auto",))[1][3]
        os.kill(pid, signal.SIGKILL)
    dist.barrier()
    exporter.bound_s = KILL_BOUND_S
    receiver = remote_slice_receiver(exporter, authkey=key, llm=llm)
    if receiver is not None:
        receiver.bound_s = KILL_BOUND_S
    return timed_error(exporter, receiver)


def timed_error(exporter: SlicedExporter, receiver: Any) -> dict[str, Any]:
    """The error one export raised (None: none), and the seconds it took on this rank."""
    start = time.monotonic()
    error = None
    try:
        exporter.export(receiver)
    except WeightExportError as raised:
        error = str(raised)
    return {"error": error, "seconds": time.monotonic() - start}


def engine_environment() -> None:
    """vLLM's settings for an engine whose workers run elsewhere, set as this script starts.

    Not at import: ``tp_sliced_server_run.py`` imports this module, and the test that runs
    it imports that one into pytest's process, where the in-process engines of the other
    tests (``test_vllm_receiver.py``) would then start their engine cores in processes of
    their own.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # nothing pickled reaches a worker
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # The CPU build binds each worker to a NUMA node of its own by default; this host has one.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> int:
    engine_environment()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one-engine", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    scenario = run_one_engine if args.one_engine else run
    write_results(args.out, scenario(args.out, dist.get_rank()))
    return 0


def write_results(out: Path, found: dict[str, Any]) -> None:
    """Every rank's ``found``, written by rank 0 as ``out/result.json`` (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(gathered, indent=1))
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
