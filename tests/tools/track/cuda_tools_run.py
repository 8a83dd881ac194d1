"""The trackers on CUDA (NCCL): run under torchrun by tests/tools/track/test_cuda_tools.py.

Prints one JSON line per rank with what the trackers saw of two shardkit training steps.
``profile_steps`` is the same workload on any device: tests/tools/track/test_memory_tracker.py runs
it on a CPU the way CUDA runs it (see there why that matters).

With bf16 mixed precision, full parameters are gathered copies at every world size (at one
rank in fp32 they would be the shards themselves, and no memory would be "unsharded"). The
optimizer is AdamW as constructed by default (on CUDA, its foreach kernels): its temporaries
put the step's peak in the optimizer step, where no activation or full parameter is alive. So
the record holds, besides the categories at that peak, the most each category reached.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from shardkit.core import MixedPrecisionPolicy, fully_shard
from shardkit.tools import Category, Profiler
from tests.core import models

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def profile_steps(device: str, *, foreach: bool | None = None) -> dict[str, Any]:
    """Two profiled shardkit steps (after one unprofiled) on the default group's ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt").to(device)
    mesh = init_device_mesh(device, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MP)
    fully_shard(model, mesh=mesh, mp_policy=MP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)

    def step(i: int) -> None:
        x, y = models.batch("gpt", i, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2].to(device), y[2 * rank : 2 * rank + 2].to(device)
        opt.zero_grad()
        models.loss_of("gpt", model(x), y).backward()
        opt.step()

    step(0)
    with Profiler(model, optimizers=[opt]) as prof:
        step(1)
        step(2)
    report = prof.rank_report()
    assert report.memory is not None and report.comm is not None
    memory = report.memory
    peak = memory.peak.by_category
    most = {c: max(s.by_category[c] for s in memory.timeline) for c in Category}
    return {
        "rank": rank,
        "device": memory.device,
        "kinds": sorted({c.kind for c in report.collectives}),
        "sent_per_step": [s.sent_bytes for s in report.comm.steps],
        "peak_phase": memory.peak.phase.value,
        "unsharded_at_peak": peak[Category.UNSHARDED_PARAMS],
        "activations_at_peak": peak[Category.ACTIVATIONS],
        "unsharded_max": most[Category.UNSHARDED_PARAMS],
        "activations_max": most[Category.ACTIVATIONS],
        "allocator": memory.allocator,
    }


def check(records: list[dict[str, Any]], nproc: int) -> list[str]:
    """What is wrong with the CUDA run's records (empty: nothing)."""
    problems = []
    if len(records) != nproc:
        problems.append(f"{len(records)} records from {nproc} ranks")
    for r in records:
        label = f"rank {r['rank']}"
        if r["device"] != "cuda" or not r["allocator"].get("peak_allocated_bytes"):
            problems.append(f"{label}: not tracked on CUDA ({r['device']}, {r['allocator']})")
        # The most each reached: the step's peak itself falls in AdamW's step, when neither
        # is alive (tests/tools/track/test_memory_tracker.py shows it on a CPU).
        if not (r["activations_max"] > 0 and r["unsharded_max"] > 0):
            problems.append(f"{label}: activations or full parameters never seen")
        if nproc > 1:
            if r["kinds"] != ["all_gather", "reduce_scatter"]:
                problems.append(f"{label}: collectives {r['kinds']}")
            steps = r["sent_per_step"]
            if not (len(steps) == 2 and steps[0] == steps[1] > 0):
                problems.append(f"{label}: bytes sent per step {steps}")
    return problems


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    record = profile_steps("cuda")
    torch.cuda.synchronize()
    sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
