"""A delta export against a full one, paired, at W=2: the trainer side's time per sync.

Usage: torchrun --nproc-per-node 2 benchmarks/export_delta_run.py SIZE LR ROUNDS [paced]

The model of ``SIZE`` (``benchmarks/export_run.py``'s Qwen2-style 5M or ~150M, fp32 masters,
shardkit's ``fully_shard`` per layer) takes an AdamW step at ``LR`` each round, then two
exporters export it into bf16 copies in rank 0's process (``ModuleReceiver``): one in full,
one with ``delta=True`` (and ``plain_when_faster`` under ``paced``), in alternating order. A
sync's trainer-side time is the slowest rank's export less rank 0's time in its receiver
(every rank waits for that receiver's commit in the export's last all-gather; until
2026-11-30 this script took each rank's export less its own receiver's time, which left rank
1's wait in a full export's time: ``ratio_each_own``).
Prints one JSON line: per round the two times and their ratio, the delta's bytes against the
full's, its buckets sent plain, and the share of bf16 elements that changed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_run import build, sharded, train_step

_BUCKET_BYTES = 512 * 2**20


def _trainer_side(exporter: Any, receiver: Any, *, delta: bool) -> tuple[float, float, Any]:
    """The slowest rank's export less rank 0's time in its receiver; and, as this script
    measured it before 2026-11-30, the slowest of each rank's export less its own receiver's
    time (which left in the full export's the other ranks' wait for that receiver: they wait
    for its commit in the export's last all-gather)."""
    dist.barrier()
    start = time.perf_counter()
    report = exporter.export(receiver, delta=delta)
    wall = time.perf_counter() - start
    seconds = torch.tensor([wall, report.handoff_seconds, wall - report.handoff_seconds])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0] - seconds[1]), float(seconds[2]), report


def main() -> None:
    size, lr, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    paced = sys.argv[4:] == ["paced"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from shardkit.core.export import ModuleReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model, optimizer = sharded(size, lr)

    def step() -> None:
        train_step(model, optimizer, size, rank)

    # One bucket of 512 MiB, as docs/guide/export.md's "A delta's time" was measured (the
    # default before 2026-11-30): the 150M model in one bucket.
    options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=_BUCKET_BYTES)
    paced_options = (
        ExportOptions(dtype=torch.bfloat16, bucket_bytes=_BUCKET_BYTES, plain_when_faster=True)
        if paced
        else options
    )
    full, delta = WeightExporter(model, options), WeightExporter(model, paced_options)
    targets: list[Any] = (
        [build(size, torch.bfloat16) for _ in range(2)] if rank == 0 else [None] * 2
    )
    into = [ModuleReceiver(t) if t is not None else None for t in targets]
    step()
    full.export(into[0])
    delta.export(into[1], delta=True)  # the first is full: what the next is relative to
    rows = []
    for r in range(rounds):
        step()
        held = targets[1].state_dict() if rank == 0 else {}
        before = {k: v.clone() for k, v in held.items()}
        order = (False, True) if r % 2 == 0 else (True, False)
        found: dict[bool, tuple[float, float, Any]] = {}
        for is_delta in order:
            found[is_delta] = _trainer_side(
                delta if is_delta else full, into[1] if is_delta else into[0], delta=is_delta
            )
        changed = sum(int((v != before[k]).sum()) for k, v in held.items()) if rank == 0 else 0
        sent = torch.tensor(
            [0 if r0.receiving else r0.counts.sent_bytes for *_, r0 in (found[False], found[True])]
        )
        dist.all_reduce(sent)
        report = found[True][2]
        rows.append(
            {
                "full_s": found[False][0],
                "delta_s": found[True][0],
                "ratio": found[True][0] / found[False][0],
                "ratio_each_own": found[True][1] / found[False][1],
                "full_bytes": int(sent[0]),
                "delta_bytes": int(sent[1]),
                "plain_buckets": report.counts.plain_buckets,
                "paced_buckets": getattr(report.counts, "paced_buckets", 0),  # older code: none
                "buckets": report.buckets,
                "changed": changed / sum(v.numel() for v in held.values()) if rank == 0 else 0.0,
            }
        )
    if rank == 0:
        ratios = [row["ratio"] for row in rows]
        print(
            json.dumps(
                {
                    "size": size,
                    "lr": lr,
                    "paced": paced,
                    "rounds": rows,
                    "ratio_median": statistics.median(ratios),
                    "ratio_each_own_median": statistics.median(
                        row["ratio_each_own"] for row in rows
                    ),
                    "full_s_median": statistics.median(row["full_s"] for row in rows),
                    "delta_s_median": statistics.median(row["delta_s"] for row in rows),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
