"""torch's ``FSDPMemTracker`` on CUDA: its peak against the allocator's, on both engines.

Run under torchrun by ``make check-gpu`` (the ``mem-tracker`` chunk); prints one JSON line per
rank and case. torch's own test of the tracker (``test_fsdp2_mem_tracker.py``,
``test_tracker_multi_group``) trains 4 MLPs, each sharded, fp16 parameters and fp32
reductions, two steps with ``reset_mod_stats`` after the first, and asks that the tracker's
peak be within 10% of the CUDA allocator's active-bytes peak. The same workload runs on
torch's ``fully_shard`` and on shardkit's, resharding after forward or not.

:func:`measure` runs on a CPU too (gloo, no allocator to compare with), which is how
``tests/core/interop/test_fsdp_mem_tracker.py`` tests this script's logic.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import shardkit.core as sk

ACCURACY = 0.1  # torch's test: the tracker's peak within 10% of the allocator's
ENGINES = ("torch", "shardkit")


def _mlp(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))


def tracked_steps(
    tracker: FSDPMemTracker,
    optim: torch.optim.Optimizer,
    forward: Callable[[], torch.Tensor],
    *,
    after_backward: Callable[[], object] | None = None,
) -> list[torch.Tensor]:
    """torch's tests' pattern: two steps under the tracker, its module stats reset after the
    first (it refuses a module's second forward in one record); each step's loss (a tensor:
    under ``FakeTensorMode``, as torchtitan's estimation runs, it has no value)."""
    losses = []
    with tracker:
        for step in range(2):
            loss = forward().float().sum()
            loss.backward()
            if after_backward is not None:
                after_backward()  # gradient clipping, say
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
            if step == 0:
                tracker.reset_mod_stats()
    return losses


def estimated(model: nn.Module, inputs: torch.Tensor) -> tuple[FSDPMemTracker, list[torch.Tensor]]:
    """torchtitan's estimation steps (its ``scripts/estimate``) on a model sharded on the meta
    device under ``FakeTensorMode``: materialized (``to_empty``, ``reset_parameters``), AdamW,
    the tracker over two steps with gradient clipping; the tracker and the losses."""
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs((inputs,))

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)

    losses = tracked_steps(tracker, optim, functools.partial(model, inputs), after_backward=clip)
    return tracker, losses


def measure(
    device: str, engine: str, reshard: bool, *, dim: int = 2048, batch: int = 8192
) -> dict[str, Any]:
    """Two tracked steps of ``engine``'s 4 sharded MLPs; the tracker's and the allocator's peak."""
    api: Any = torch_fsdp if engine == "torch" else sk
    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gc.collect()
    before = 0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_accumulated_memory_stats(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_stats(dev)["active_bytes.all.current"]
    torch.manual_seed(42)
    with torch.device(dev):
        model = nn.Sequential(*[_mlp(dim) for _ in range(4)])
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = api.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model:
        api.fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    inputs = torch.randn(batch, dim, device=dev)
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs((inputs,))
    steps = tracked_steps(tracker, optim, functools.partial(model, inputs))
    losses = [loss.item() for loss in steps]
    tracker_max = int(tracker.get_tracker_snapshot("peak")[dev]["Total"])
    allocator_max = None
    if cuda:
        torch.cuda.synchronize()
        allocator_max = torch.cuda.memory_stats(dev)["active_bytes.all.peak"] - before
    del model, optim, inputs, tracker
    return {
        "rank": dist.get_rank(),
        "engine": engine,
        "reshard": reshard,
        "losses": losses,
        "tracker_max": tracker_max,
        "allocator_max": allocator_max,
    }


def run_all(device: str, **sizes: int) -> list[dict[str, Any]]:
    """Every case, both engines, on this rank."""
    return [measure(device, e, r, **sizes) for r in (True, False) for e in ENGINES]


def check(records: list[dict[str, Any]], nproc: int) -> list[str]:
    """What is wrong with the records of every rank (empty: nothing)."""
    problems = []
    cases = {(r["engine"], r["reshard"]) for r in records}
    expected = {(e, r) for e in ENGINES for r in (True, False)}
    if cases != expected or len(records) != nproc * len(expected):
        problems.append(f"{len(records)} records of {sorted(cases)} from {nproc} ranks")
    for r in records:
        label = f"rank {r['rank']} {r['engine']} reshard={r['reshard']}"
        if not r["tracker_max"] > 0:
            problems.append(f"{label}: the tracker saw no memory")
        if r["allocator_max"] is not None:
            accuracy = r["tracker_max"] / r["allocator_max"]
            if abs(accuracy - 1.0) > ACCURACY:
                problems.append(
                    f"{label}: tracker {r['tracker_max']} B vs allocator {r['allocator_max']} B "
                    f"({accuracy:.3f})"
                )
    return problems


def figures(records: list[dict[str, Any]]) -> str:
    """Rank 0's accuracy per engine and case, and shardkit's peak against torch's."""
    mine = {(r["engine"], r["reshard"]): r for r in records if r["rank"] == 0}
    parts = []
    for reshard in (True, False):
        ours, theirs = mine.get(("shardkit", reshard)), mine.get(("torch", reshard))
        if ours is None or theirs is None or ours["allocator_max"] is None:
            continue
        accuracy = {
            name: r["tracker_max"] / r["allocator_max"]
            for name, r in (("torch", theirs), ("shardkit", ours))
        }
        parts.append(
            f"reshard={reshard}: accuracy torch {accuracy['torch']:.3f}, shardkit "
            f"{accuracy['shardkit']:.3f}; peak "
            f"{ours['allocator_max'] / theirs['allocator_max']:.2f}x torch's"
        )
    return "; ".join(parts)


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    # cuBLAS's workspace, allocated once by the first matmul, is not the tracker's to see.
    lin = nn.Linear(768, 768, device="cuda")
    lin(torch.randn(1, 768, device="cuda")).sum().backward()
    del lin
    for record in run_all("cuda"):
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
