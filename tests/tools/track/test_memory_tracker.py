"""MemoryTracker on every engine: exact resident categories, peaks, activations and cleanup."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from shardkit.tools.records import Category, Phase, RankReport
from shardkit.tools.track.memory import MemoryTracker
from tests.core import models
from tests.tools import workloads
from tests.tools.track.cuda_tools_run import profile_steps


def _tracked(rank: int, world_size: int, engine: str, steps: int) -> dict[str, Any]:
    model, opt = workloads.build(engine, world_size, "gpt")
    workloads.train_step(model, opt, 0, rank, world_size, "gpt")  # optimizer state exists
    original_resize = torch.UntypedStorage.resize_
    with MemoryTracker(model, optimizers=[opt]) as mem:
        assert torch.UntypedStorage.resize_ is not original_resize, "resize_ not observed"
        for step in range(steps):
            workloads.train_step(model, opt, 1 + step, rank, world_size, "gpt")
    assert torch.UntypedStorage.resize_ is original_resize, "resize_ was not restored"
    return RankReport(rank=rank, world_size=world_size, memory=mem.report()).to_dict()


def _shard_bytes(world_size: int, align: int) -> int:
    """Bytes of one rank's padded fp32 shards of the tiny GPT (blocks and root sharded)."""
    total = 0
    for param in models.build("gpt").parameters():
        chunk = math.ceil(param.shape[0] / world_size) * math.prod(param.shape[1:]) * 4
        total += math.ceil(chunk / align) * align
    return total


def _local_bytes(world_size: int, rank: int) -> int:
    """Bytes of ``rank``'s real (unpadded) fp32 shards: what the optimizer's state is like."""
    total = 0
    for param in models.build("gpt").parameters():
        chunk = math.ceil(param.shape[0] / world_size)
        rows = max(0, min(chunk, param.shape[0] - rank * chunk))
        total += rows * math.prod(param.shape[1:]) * 4
    return total


@pytest.mark.parametrize(("engine", "align"), [("shardkit", 16), ("torch", 1)])
def test_fully_shard_resident_memory_is_exact(engine: str, align: int) -> None:
    reports = run_on_ranks(2, _tracked, engine=engine, steps=2)
    params = sum(1 for _ in models.build("gpt").parameters())
    for rank, raw in enumerate(reports):
        memory = RankReport.from_dict(raw).memory
        assert memory is not None and memory.device == "cpu"
        end = memory.timeline[-1].by_category
        sharded = _shard_bytes(2, align)
        assert end[Category.SHARDED_PARAMS] == sharded
        assert end[Category.UNSHARDED_PARAMS] == 0  # every group resharded after backward
        assert end[Category.ACTIVATIONS] == 0
        # AdamW: exp_avg and exp_avg_sq like the shard, and a float32 step per parameter.
        assert end[Category.OPTIMIZER_STATE] == 2 * _local_bytes(2, rank) + 4 * params
        # Both engines reduce into a padded shard (no alignment) and keep it as the gradient.
        assert end[Category.GRADIENTS] == _shard_bytes(2, 1)
        peak = memory.peak.by_category
        full = 4 * workloads.param_count("gpt")
        assert 0 < peak[Category.UNSHARDED_PARAMS] <= full
        assert peak[Category.ACTIVATIONS] > 0 and peak[Category.COMM_BUFFERS] > 0
        assert memory.peak.phase in (Phase.FORWARD, Phase.BACKWARD)
        modules = {p.module for p in memory.module_peaks}
        assert {"blocks.0", "blocks.1", "blocks.1.mlp"} <= modules
        assert memory.module_peaks[0].peak.total == memory.peak.total


def test_shardkit_gradients_are_the_reduced_shards() -> None:
    raw = run_on_ranks(2, _tracked, engine="shardkit", steps=1)[0]
    memory = RankReport.from_dict(raw).memory
    assert memory is not None
    # Sharded gradients live in the reduce-scatter outputs: unpadded by alignment.
    assert memory.timeline[-1].by_category[Category.GRADIENTS] >= _shard_bytes(2, 1)


def test_ddp_buckets_are_communication_buffers() -> None:
    raw = run_on_ranks(2, _tracked, engine="ddp", steps=1)[0]
    memory = RankReport.from_dict(raw).memory
    assert memory is not None
    end = memory.timeline[-1].by_category
    full = 4 * workloads.param_count("gpt")
    assert end[Category.SHARDED_PARAMS] == full  # DDP: every rank holds the whole model
    assert end[Category.COMM_BUFFERS] >= full  # the all-reduce buckets
    assert end[Category.UNSHARDED_PARAMS] == 0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()  # the output
    return sum(storages.values())


def test_activations_match_what_autograd_saves() -> None:
    torch.manual_seed(0)
    model = _Net()
    expected = _saved_activation_bytes(model, torch.randn(32, 64))
    seen: list[dict[Category, int]] = []
    with MemoryTracker(model) as mem:
        x = torch.randn(32, 64)  # saved by fc1, but made outside forward: "other", not activation
        out = model(x)
        mem._advance()
        seen.append(dict(mem.replay.live))
        out.sum().backward()
        del out  # the output was an activation too, alive while referenced
    assert seen[0][Category.ACTIVATIONS] == expected - x.numel() * 4
    assert seen[0][Category.OTHER] == x.numel() * 4
    report = mem.report()
    assert report.timeline[-1].by_category[Category.ACTIVATIONS] == 0
    assert report.timeline[-1].by_category[Category.SHARDED_PARAMS] == 4 * sum(
        p.numel() for p in model.parameters()
    )
    assert (
        report.timeline[-1].by_category[Category.GRADIENTS]
        == report.timeline[-1].by_category[Category.SHARDED_PARAMS]
    )


def test_refuses_to_start_twice() -> None:
    tracker = MemoryTracker().start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            tracker.start()
    finally:
        tracker.stop()


def _profiled(rank: int, world_size: int, foreach: bool) -> dict[str, Any]:
    return profile_steps("cpu", foreach=foreach)


def test_the_cuda_tools_run_on_a_cpu() -> None:
    # tests/tools/track/cuda_tools_run.py's workload as CUDA runs it (AdamW's foreach path, CUDA's
    # default). AdamW's temporaries make the optimizer step the peak, where no activation and
    # no full parameter lives: what the CUDA test once read there was 0, rightly (and at one
    # rank in fp32 the full parameters are the shards: no memory is "unsharded" at all).
    record = run_on_ranks(1, _profiled, foreach=True)[0]
    assert record["peak_phase"] == Phase.OPTIMIZER.value
    assert record["activations_at_peak"] == 0 and record["unsharded_at_peak"] == 0
    # The most each reached is what says the trackers saw them (bf16: full parameters are
    # copies even at one rank).
    assert record["activations_max"] > 0 and record["unsharded_max"] > 0
    assert record["kinds"] == [] and record["device"] == "cpu"
