"""``replicate`` (DDP on FSDP's engine) against torch's: step time, losses, peak memory.

Usage: torchrun --nproc-per-node 2 benchmarks/replicate_run.py time
       torchrun --nproc-per-node 2 benchmarks/replicate_run.py memory IMPL
Rank 0 prints one JSON line.

``time``: both engines in one process, each on its own copy of the "small" GPT of
``benchmarks/gpt.py`` (8.4M parameters; each block and the root replicated), AdamW, in paired
rounds of 4 steps with the order flipped every round (a loaded machine slows both alike); the
first round is warm-up. ``{"shardkit_ms", "torch_ms"}`` are median step times, ``"same_losses"``
whether the two engines' losses were equal bit for bit at every step.

``memory IMPL``: one engine alone, the peak of live tensor memory over two steps
(MemoryTracker) and the process's peak RSS (run with MALLOC_MMAP_THRESHOLD_=65536).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpt import SIZES, batch
from shardkit.tools.plan.gpt import GPT

SIZE = "small"
ROUNDS, STEPS_PER_ROUND = 5, 4


def build(impl: str, mesh: DeviceMesh) -> tuple[Any, torch.optim.Optimizer]:
    """The GPT, each block then the root replicated by ``impl``; its optimizer."""
    torch.manual_seed(0)
    model: Any = GPT(SIZES[SIZE].model)
    from torch.distributed._composable import replicate_with_fsdp

    import shardkit.core

    replicate: Any = (shardkit.core if impl == "shardkit" else replicate_with_fsdp).replicate
    for block in model.blocks:
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: Any, opt: torch.optim.Optimizer, index: int) -> float:
    """One training step on this rank's rows of batch ``index``; its local loss."""
    idx = batch(SIZE, index, dist.get_rank(), dist.get_world_size())
    out = model(idx[:, :-1])
    loss = F.cross_entropy(out.reshape(-1, out.size(-1)), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def measure_time(mesh: DeviceMesh) -> dict[str, Any]:
    runs = {impl: build(impl, mesh) for impl in ("torch", "shardkit")}
    times: dict[str, list[float]] = {impl: [] for impl in runs}
    losses: dict[str, list[float]] = {impl: [] for impl in runs}
    for rnd in range(ROUNDS):
        order = ("torch", "shardkit") if rnd % 2 == 0 else ("shardkit", "torch")
        for impl in order:
            model, opt = runs[impl]
            for k in range(STEPS_PER_ROUND):
                dist.barrier()
                start = time.perf_counter()
                losses[impl].append(step(model, opt, rnd * STEPS_PER_ROUND + k))
                dist.barrier()
                if rnd > 0:
                    times[impl].append(time.perf_counter() - start)
    return {
        "shardkit_ms": 1000 * statistics.median(times["shardkit"]),
        "torch_ms": 1000 * statistics.median(times["torch"]),
        "same_losses": losses["shardkit"] == losses["torch"],
    }


def measure_memory(impl: str, mesh: DeviceMesh) -> dict[str, Any]:
    from shardkit.tools import MemoryTracker

    model, opt = build(impl, mesh)
    step(model, opt, 0)  # the optimizer's state, lazy init
    with MemoryTracker(model, optimizers=[opt]) as tracker:
        step(model, opt, 1)
        step(model, opt, 2)
    return {
        "peak_mib": tracker.report().peak.total / 2**20,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    record = measure_time(mesh) if sys.argv[1] == "time" else measure_memory(sys.argv[2], mesh)
    if dist.get_rank() == 0:
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
