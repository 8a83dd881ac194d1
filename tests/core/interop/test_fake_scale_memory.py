"""The fake-group points' peak memory: shardkit's at most torch's ``fully_shard``'s, on a CPU.

On an H200 (docs/performance.md, "On one GPU") shardkit's peak allocated memory was above
torch's at every W>1 of the fake process group, growing with W (issue 64). Here each engine
trains the benchmark GPT with the GPU points' settings (bf16 mixed precision, activation
checkpointing, meta-device init; ``benchmarks/fake_scale.py``'s ``OPTIONS``) as rank 0 of W on
torch's fake process group, and torch's profiler reports every allocation of the CPU allocator,
as CUDA's allocator counts them for ``max_memory_allocated``: the peak is that of the bytes
allocated since the model was built, over the steps after the first optimizer step. Byte
counts, the same on any machine; never times.

Before issue 64, each rank's row of shardkit's all-gather was rounded up to 16 bytes, so every
all-gather buffer held W times the difference, and each group kept a (W, difference) scratch
for the split that copies rows out: 2,560 bytes above torch's peak at W=64 here, equal at W=8.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from benchmarks import gpt
from benchmarks.fake_scale import OPTIONS
from torch.profiler import ProfilerActivity, profile, record_function
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.allocations import allocated_peak

SIZE = "fake-scale-cpu"
WARMUP = 2  # the first step makes the optimizer's state; the second runs as every later one
MEASURED = "## measured"


def _peak_allocated(engine: str, world: int) -> int:
    """The highest bytes the CPU allocator held during a step after ``WARMUP`` steps."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model, opt = gpt.build(engine, SIZE, world, OPTIONS, device="cpu")
            for step in range(WARMUP):
                gpt.train_step(model, opt, gpt.batch(SIZE, step, 0, world))
            with record_function(MEASURED):
                gpt.train_step(model, opt, gpt.batch(SIZE, WARMUP, 0, world))
            del model, opt
    finally:
        dist.destroy_process_group()
    return allocated_peak(prof, within=MEASURED)


@pytest.mark.parametrize("world", [8, 64])
def test_the_peak_is_at_most_torchs_on_the_fake_group(world: int) -> None:
    ours, theirs = _peak_allocated("shardkit", world), _peak_allocated("torch", world)
    print(f"W={world}: shardkit {ours:,} bytes, torch {theirs:,} ({ours - theirs:+,})")
    assert ours <= theirs, f"W={world}: shardkit's peak {ours:,} > torch's {theirs:,}"
