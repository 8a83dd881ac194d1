"""The weight export (issue 74) on a GPU: bit-identity, the transports, time and peak memory.

Usage: torchrun --nproc-per-node N benchmarks/cuda_export_run.py [--device cuda|cpu]
           [--size 150m|5m] [--syncs 10] [--rounds 5]

On ``cuda`` the default group is made with ``init_process_group("nccl")`` alone, as torchrun
scripts for GPUs make it: a group with no CPU backend, so every collective of the export (its
small agreement vectors too) must run on device tensors. ``cpu`` runs the same code on gloo
(``make check-gpu --cpu-smoke``).

For each engine (shardkit's ``fully_shard``, then torch's), the Qwen2-style model of
``benchmarks/export_run.py`` (fp32 masters on the device, one ``fully_shard`` per layer) takes
``--syncs`` AdamW steps at lr 1e-6, each followed by an export to three receivers, each with
its exporter (full first, then deltas):

- ``colocated``: a bf16 copy on the device, in rank 0's process (``ModuleReceiver``). After
  every sync each of its tensors must equal the trainer's ``full_tensor().to(bf16)``, bit for
  bit;
- ``shm`` and ``group``: a bf16 copy in a process of its own on the host, behind the shared-
  memory and the process-group transports (device to host on the way: a CPU build of vLLM
  beside a GPU trainer, or verl's mode without IPC). Their receivers check every payload
  before they write.

Then ``--rounds`` rounds into the colocated receiver, the device synchronised around each
timing: a training step at lr 1e-6, a delta export timed (issue 86: at most 0.3x a full
export's time where at most 5% of the elements change; on one GPU the receiver's part is in
it), then a delta and a full export into the ``shm`` receiver (its process on the host: the
wire is the device-to-host copy, where the delta's few percent of the bytes should pay for its
comparison on the device; the host process's load of what it is handed is in both times), then
a full export timed beside trl's pattern (``export_run.trl_sync``: one ``full_tensor()`` per
parameter, cast and handed over alone), alternating which goes first; and the peak allocated
memory each adds, beside a training step's. The receiver is checked
bit for bit once more after the last round. Rank 0 prints one JSON line per engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_run import SIZES, _receiver, build, trl_sync

TRANSPORTS = ("colocated", "shm", "group")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _peak_added(device: str, work: Callable[[], object]) -> tuple[float, float]:
    """Run ``work``; its seconds and the peak allocated memory it added (MiB; 0 on a CPU)."""
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _allocated(device)
    start = time.perf_counter()
    work()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return seconds, (peak - before) / 2**20


def _mismatches(model: torch.nn.Module, replica: torch.nn.Module | None) -> list[str]:
    """Names whose receiver tensor differs in any bit from the trainer's, cast to bf16.

    Every rank calls it (``full_tensor()`` is a collective); ``replica`` on rank 0 alone.
    """
    from torch.distributed.tensor import DTensor

    held = replica.state_dict() if replica is not None else {}
    wrong = []
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if replica is None:
            continue
        expected = full.to(torch.bfloat16).view(torch.int16)
        if not torch.equal(held[name].view(torch.int16), expected.to(held[name].device)):
            wrong.append(name)
    return wrong


def run_engine(impl: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine's syncs, checks and timings (every rank); rank 0's record."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.core as shardkit_core
    from shardkit.core.export import ExportOptions, ModuleReceiver, WeightExporter

    api: Any = shardkit_core if impl == "shardkit" else torch_fsdp
    device, rank = args.device, dist.get_rank()
    model = build(args.size, torch.float32).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model.model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=64 * 2**20)
    receivers: dict[str, Any] = {}
    closers: list[Callable[[], None]] = []
    replica: torch.nn.Module | None = None
    if rank == 0:
        replica = build(args.size, torch.bfloat16).to(device)
        receivers["colocated"] = ModuleReceiver(replica)
        for transport in TRANSPORTS[1:]:
            receivers[transport], close = _receiver(transport, args.size)
            closers.append(close)
    exporters = {t: WeightExporter(model, options) for t in TRANSPORTS}

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(1000 * seed + rank)
        ids = torch.randint(0, SIZES[args.size]["vocab_size"], (1, 64), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    wrong: list[str] = []
    handed: dict[str, list[int]] = {t: [] for t in TRANSPORTS}
    errors: list[str] = []
    step_s, step_peak = 0.0, 0.0
    for sync in range(args.syncs):
        step_s, step_peak = _peak_added(device, functools.partial(step, sync))
        for transport in TRANSPORTS:
            try:
                report = exporters[transport].export(receivers.get(transport), delta=sync > 0)
            except Exception as error:  # every transport is tried; the record says which failed
                errors.append(f"sync {sync} {transport}: {type(error).__name__}: {error}")
                continue
            handed[transport].append(report.counts.handed_bytes)
        wrong += [f"sync {sync}: {name}" for name in _mismatches(model, replica)[:3]]
    # Timing: full exports against trl's pattern into receivers of the same kind.
    # The full exports timed go through exporters and receivers of their own: an exporter's
    # delta after its own full export is full again (a full export keeps no part to compare
    # with), so the delta exporters above export deltas only.
    full_receivers: dict[str, Any] = {"trl": None, "colocated": None, "shm": None}
    if rank == 0:
        full_receivers["trl"] = ModuleReceiver(build(args.size, torch.bfloat16).to(device))
        full_receivers["colocated"] = ModuleReceiver(build(args.size, torch.bfloat16).to(device))
        full_receivers["shm"], close = _receiver("shm", args.size)
        closers.append(close)
    full_exporters = {t: WeightExporter(model, options) for t in ("colocated", "shm")}
    times: dict[str, list[float]] = {k: [] for k in ("ours", "trl", "delta", "host", "host_delta")}
    peaks: dict[str, float] = {"ours": 0.0, "trl": 0.0, "delta": 0.0}
    delta_bytes: list[int] = []
    for r in range(args.rounds):
        # A delta after one step at lr 1e-6 (issue 86's case), relative to the last round's
        # delta, then a full export and trl's pattern on the same weights.
        step(args.syncs + r)
        dist.barrier()
        seconds, peak = _peak_added(
            device, lambda: delta_bytes.append(
                exporters["colocated"].export(receivers.get("colocated"), delta=True)
                .counts.handed_bytes
            ),
        )  # fmt: skip
        times["delta"].append(seconds)
        peaks["delta"] = max(peaks["delta"], peak)
        # The same into the shared-memory receivers' processes on the host: the wire is the
        # device-to-host copy, where a delta's few percent of the bytes should pay for its
        # comparison on the device (on one CPU host, with no such wire, it cannot).
        for kind in ("host_delta", "host") if r % 2 == 0 else ("host", "host_delta"):
            dist.barrier()
            work: Callable[[], object] = (
                functools.partial(exporters["shm"].export, receivers.get("shm"), delta=True)
                if kind == "host_delta"
                else functools.partial(full_exporters["shm"].export, full_receivers["shm"])
            )
            times[kind].append(_peak_added(device, work)[0])
        for kind in ("trl", "ours") if r % 2 == 0 else ("ours", "trl"):
            dist.barrier()
            work = (
                functools.partial(trl_sync, model, full_receivers["trl"])
                if kind == "trl"
                else functools.partial(
                    full_exporters["colocated"].export, full_receivers["colocated"]
                )
            )
            seconds, peak = _peak_added(device, work)
            times[kind].append(seconds)
            peaks[kind] = max(peaks[kind], peak)
    wrong += [f"after the timed rounds: {name}" for name in _mismatches(model, replica)[:3]]
    for close in closers:
        close()
    ours_s, trl_s = statistics.median(times["ours"]), statistics.median(times["trl"])
    full = handed["colocated"][0] if handed["colocated"] else 0
    # The first export asked as a delta is full (there is nothing yet to be relative to).
    deltas = handed["colocated"][2:]
    return {
        "impl": impl,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "",
        "world": dist.get_world_size(),
        "size": args.size,
        "params": sum(p.numel() for p in model.parameters()),
        "syncs": args.syncs,
        "identical": not wrong and not errors,
        "mismatches": wrong[:10],
        "errors": errors[:6],
        "exports": {t: len(v) for t, v in handed.items()},
        "full_handed_bytes": full,
        "delta_share_max": max(deltas) / full if deltas and full else None,
        "export_s": ours_s,
        "trl_s": trl_s,
        "export_vs_trl": ours_s / trl_s,
        "export_peak_mib": peaks["ours"],
        "delta_s": statistics.median(times["delta"]),
        "delta_vs_full": statistics.median(times["delta"]) / ours_s,
        "delta_share": statistics.median(delta_bytes) / full if full else None,
        "delta_peak_mib": peaks["delta"],
        "host_full_s": statistics.median(times["host"]),
        "host_delta_s": statistics.median(times["host_delta"]),
        "host_delta_vs_full": statistics.median(
            d / f for d, f in zip(times["host_delta"], times["host"], strict=True)
        ),
        "trl_peak_mib": peaks["trl"],
        "step_s": step_s,
        "step_peak_mib": step_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="150m", choices=sorted(SIZES))
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")  # no CPU backend: the export must not need one
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    for impl in ("shardkit", "torch"):
        record = run_engine(impl, args)
        if dist.get_rank() == 0:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
