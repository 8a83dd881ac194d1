"""Training-step timings on CUDA (NCCL, one process per GPU): shardkit vs torch's fully_shard.

Usage: torchrun --nproc-per-node N benchmarks/cuda_run.py SIZE ROUNDS
Both implementations are built side by side; every round runs one step of each, alternating
which goes first, with the GPU synchronised around each step. Rank 0 prints one JSON line:
{"world", "size", "shardkit_s", "torch_s", "ratio", "peak_alloc_mib": {impl: MiB}}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt

IMPLS = ("torch", "shardkit")


def _timed_step(model: object, opt: torch.optim.Optimizer, data: torch.Tensor) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    gpt.train_step(model, opt, data)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    size, rounds = sys.argv[1], int(sys.argv[2])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {impl: gpt.build(impl, size, world, device="cuda") for impl in IMPLS}
    peaks: dict[str, float] = {}
    for impl, (model, opt) in built.items():  # warm-up, and each one's own peak memory
        torch.cuda.reset_peak_memory_stats()
        for step in range(3):
            gpt.train_step(model, opt, gpt.batch(size, step, rank, world).cuda())
        peaks[impl] = torch.cuda.max_memory_allocated() / 2**20
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for step in range(rounds):
        data = gpt.batch(size, 10 + step, rank, world).cuda()
        for impl in IMPLS if step % 2 else reversed(IMPLS):
            times[impl].append(_timed_step(*built[impl], data))
    ratios = [s / t for s, t in zip(times["shardkit"], times["torch"], strict=True)]
    if rank == 0:
        record = {
            "world": world,
            "size": size,
            "shardkit_s": statistics.median(times["shardkit"]),
            "torch_s": statistics.median(times["torch"]),
            "ratio": statistics.median(ratios),
            "peak_alloc_mib": peaks,
        }
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
