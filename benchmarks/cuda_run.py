"""Training-step time and peak memory of one engine on CUDA (NCCL, one process per GPU).

Usage: torchrun --nproc-per-node N benchmarks/cuda_run.py SIZE ROUNDS IMPL [bf16]

One engine per process, so its peak allocated memory is its own (built side by side, each
engine's peak would include the other's parameters and optimizer state). After three warm-up
steps the peak is reset, then ROUNDS steps are timed, the GPU synchronised around each. Rank 0
prints one JSON line: {"world", "size", "impl", "bf16", "step_s", "peak_alloc_mib", "gpu"}.

At one GPU (W=1) shardkit takes its one-rank path: no collective at all, where torch's
``fully_shard`` runs its NCCL collectives on one rank. That ratio says how the engines compare
on one GPU, nothing about W>1: benchmarks/fake_scale.py measures those points.
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


def _timed_step(model: object, opt: torch.optim.Optimizer, data: torch.Tensor) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    gpt.train_step(model, opt, data)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    size, rounds, impl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    bf16 = sys.argv[4:] == ["bf16"]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = gpt.build(impl, size, world, gpt.Options(bf16=bf16), device="cuda")
    for step in range(3):
        gpt.train_step(model, opt, gpt.batch(size, step, rank, world).cuda())
    torch.cuda.reset_peak_memory_stats()
    times = [
        _timed_step(model, opt, gpt.batch(size, 10 + step, rank, world).cuda())
        for step in range(rounds)
    ]
    if rank == 0:
        record = {
            "world": world,
            "size": size,
            "impl": impl,
            "bf16": bf16,
            "step_s": statistics.median(times),
            "peak_alloc_mib": torch.cuda.max_memory_allocated() / 2**20,
            "gpu": torch.cuda.get_device_name(),
        }
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
