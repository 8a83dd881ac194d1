"""Where a delta export's time goes, stage by stage on each rank, beside a full export's.

Usage: torchrun --nproc-per-node 2 benchmarks/export_delta_profile.py SIZE LR ROUNDS [paced]

The model of ``SIZE`` (``benchmarks/export_run.py``'s, fp32 masters, W=2) takes an AdamW step
at ``LR`` each round; then a full export and a delta export (bf16, into ``ModuleReceiver`` in
rank 0's process) run under torch's profiler. The stages are the profiler's own op times
(self CPU time: ``aten::copy_`` is the cast, ``aten::ne`` the comparison, ``aten::nonzero``
the positions, ...) and named ranges around the export's steps (the count, the encoding, the
gathers, the decoding, the split into tensors, the receiver's load). Prints one JSON line per
rank: per export kind, seconds per stage per export (the mean over its syncs), the wall time,
and the count of kernels launched per export outside the receiver. ``paced``: the delta
exporter with ``plain_when_faster``, its rows from the syncs it sent plain, uncompared, only.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_run import build, sharded, train_step

RANGES = {
    "shardkit.core.export.delta_transfer": ("refresh_part", "encode", "decode", "split_changes"),
    "shardkit.core.export.exporter": ("count_changes",),
}
OPS = {
    "aten::copy_": "cast / copy",
    "aten::ne": "compare",
    "aten::nonzero": "positions (nonzero)",
    "aten::index_select": "lanes (index_select)",
    "aten::index_copy_": "write-back (index_copy_)",
}


_BUCKET_BYTES = 512 * 2**20


def _ranged(name: str, work: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(work)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"stage::{name}"):
            return work(*args, **kwargs)

    return run


def _instrument() -> None:
    import importlib

    from shardkit.core.export import exporter, transfer

    for module_name, names in RANGES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _ranged(name, getattr(module, name)))
    transfer.BucketTransfer.gather = _ranged("gather (changes)", transfer.BucketTransfer.gather)  # type: ignore[method-assign]
    transfer.BucketTransfer._gather_pieces = _ranged(  # type: ignore[method-assign]
        "gather (pieces)", transfer.BucketTransfer._gather_pieces
    )
    transfer.BucketTransfer._pack = _ranged("pack", transfer.BucketTransfer._pack)  # type: ignore[method-assign]
    exporter.WeightExporter._all_gather = _ranged(  # type: ignore[method-assign]
        "agreement all-gathers", exporter.WeightExporter._all_gather
    )
    transfer.BucketTransfer.guarded = _ranged("receiver", transfer.BucketTransfer.guarded)  # type: ignore[method-assign]


def _stages(prof: Any) -> dict[str, float]:
    found: dict[str, float] = {"kernels, trainer side (count)": float(_trainer_kernels(prof))}
    for event in prof.key_averages():
        if event.key.startswith("stage::"):
            found[event.key[len("stage::") :]] = event.cpu_time_total / 1e6
        elif event.key in OPS:
            found[OPS[event.key]] = event.self_cpu_time_total / 1e6
    return found


VIEWS = {
    "aten::" + name
    for name in [
        "view",
        "as_strided",
        "slice",
        "reshape",
        "detach",
        "view_as",
        "select",
        "alias",
        "unsqueeze",
        "squeeze",
        "expand",
        "t",
        "transpose",
        "permute",
        "narrow",
        "unbind",
        "split",
        "lift_fresh",
        "_reshape_alias",
        "item",
        "_local_scalar_dense",
    ]
}
"""Ops that move no data (views, and reading a scalar the host asked for): no kernel."""


def _trainer_kernels(prof: Any) -> int:
    """The aten ops outside the receiver that run a kernel (nested ones included: a ``copy_``
    under a ``to`` counts too), what a GPU would pay a launch for each."""
    events = prof.events()
    inside = [(e.time_range.start, e.time_range.end) for e in events if e.name == "stage::receiver"]
    return sum(
        1
        for e in events
        if e.name.startswith("aten::")
        and e.name not in VIEWS
        and not any(lo <= e.time_range.start < hi for lo, hi in inside)
    )


def main() -> None:
    size, lr, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    paced = sys.argv[4:] == ["paced"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _instrument()
    from shardkit.core.export import ModuleReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model, optimizer = sharded(size, lr)
    # One bucket of 512 MiB, as docs/guide/export.md's "A delta's time" was measured (the
    # default before 2026-11-30): the 150M model in one bucket.
    options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=_BUCKET_BYTES)
    paced_options = (
        ExportOptions(dtype=torch.bfloat16, bucket_bytes=_BUCKET_BYTES, plain_when_faster=True)
        if paced
        else options
    )
    full, delta = WeightExporter(model, options), WeightExporter(model, paced_options)
    targets = [build(size, torch.bfloat16) for _ in range(2)] if rank == 0 else [None] * 2
    into = [ModuleReceiver(t) if t is not None else None for t in targets]
    train_step(model, optimizer, size, rank)
    full.export(into[0])
    delta.export(into[1], delta=True)
    result: dict[str, Any] = {"rank": rank, "size": size, "lr": lr}
    walls: dict[str, list[float]] = {"full": [], "delta": []}
    profiles: dict[str, Any] = {}
    changed = []
    for _ in range(rounds):
        train_step(model, optimizer, size, rank)
        for kind, exporter, receiver in (("full", full, into[0]), ("delta", delta, into[1])):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                report = exporter.export(receiver, delta=kind == "delta")
                wall = time.perf_counter() - start
            if kind == "delta":
                changed.append(report.counts.plain_buckets)
                if paced and not report.counts.paced_buckets:
                    continue  # paced: the syncs that went plain uncompared only
            walls[kind].append(wall)
            profiles.setdefault(kind, []).append(_stages(prof))
    for kind, rows in profiles.items():
        total: dict[str, float] = {}
        for row in rows:
            for key, value in row.items():
                total[key] = total.get(key, 0.0) + value / len(rows)
        result[kind] = {"wall_s": sum(walls[kind]) / len(rows), "syncs": len(rows), **total}
    result["plain_buckets"] = changed
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
