"""What ``bench_muon.py``'s workers run: one GPT per optimizer, steps, the floor, peak memory.

Each worker builds the benchmark GPT (``gpt.build``, shardkit's ``fully_shard`` per block and
at the root) once per configuration, so that every configuration starts from the same weights
and the rounds alternate between them with nothing rebuilt:

- ``adamw``: AdamW on every parameter (the peer);
- ``muon``: shardkit's Muon on the blocks' matrices, AdamW on the rest (docs/guide/muon.md's
  groups);
- ``torch-muon``: ``torch.optim.Muon`` on the same shards, AdamW on the rest, its refusal
  bypassed (``muon_baselines.unhooked_step``): wrong, a floor;
- ``gather``: ``muon_baselines.GatherEverythingMuon``, AdamW on the rest.

A step's batch is the size's benchmark batch (``gpt.batch``) times ``scale``: ``scale``
consecutive batches, one sequence after another, so 8 is eight times the tokens.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import gpt
from benchmarks.muon_baselines import GatherEverythingMuon, newton_schulz_share, unhooked_step

CONFIGS = ("adamw", "muon", "torch-muon", "gather")
MUON_LR = 0.02

_STATE: dict[str, Any] = {}


def _takes_muon(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and name.startswith("blocks.")


def _optimizers(model: Any, config: str, adamw: torch.optim.Optimizer) -> list[Any]:
    if config == "adamw":
        return [adamw]
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if _takes_muon(n, p)]
    others = [p for n, p in named if not _takes_muon(n, p)]
    rest = torch.optim.AdamW(others, lr=1e-3, weight_decay=0.01)
    if config == "muon":
        from shardkit.core.optim import Muon

        return [Muon(matrices, lr=MUON_LR), rest]
    if config == "torch-muon":
        return [torch.optim.Muon([p for _, p in matrices], lr=MUON_LR), rest]
    assert config == "gather", config
    return [GatherEverythingMuon([p for _, p in matrices], lr=MUON_LR), rest]


def setup(rank: int, world_size: int, size: str, scale: int, configs: tuple[str, ...]) -> None:
    """Build every configuration and run two warm-up steps of each."""
    _STATE.clear()
    _STATE.update(size=size, scale=scale)
    for config in configs:
        model, adamw = gpt.build("shardkit", size, world_size)
        _STATE[config] = (model, _optimizers(model, config, adamw))
        for step in range(2):  # lazy init, the allocator, the optimizers' state
            step_seconds(rank, world_size, config, step)
    model = _STATE[configs[0]][0]
    _STATE["shapes"] = [(p.size(0), p.size(1)) for n, p in model.named_parameters()
                        if _takes_muon(n, p)]  # fmt: skip


def _batch(rank: int, world_size: int, step: int) -> torch.Tensor:
    size, scale = _STATE["size"], _STATE["scale"]
    parts = [gpt.batch(size, step * scale + k, rank, world_size) for k in range(scale)]
    return torch.cat(parts)


def _forward_backward(config: str, data: torch.Tensor) -> None:
    model, opts = _STATE[config]
    for opt in opts:
        opt.zero_grad()
    out = model(data[:, :-1])
    loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1))
    loss.backward()
    loss.item()


def _optimizer_step(config: str) -> None:
    for opt in _STATE[config][1]:
        if config == "torch-muon" and isinstance(opt, torch.optim.Muon):
            unhooked_step(opt)
        else:
            opt.step()


def _train_step(config: str, data: torch.Tensor) -> None:
    _forward_backward(config, data)
    _optimizer_step(config)


def step_seconds(rank: int, world_size: int, config: str, step: int) -> tuple[float, float]:
    """One training step of ``config``, timed on this rank in two parts, each from a barrier
    (every rank starts together, as the floor's do): the forward and backward, then the
    optimizers' step.

    The two parts' slowest ranks add up to the step's time. The second part alone is where
    the configurations differ (the forward and backward are the same code on the same
    batches), and it is a few tens of milliseconds where a step at 8x the tokens is seconds:
    its difference between Muon and AdamW is the same quantity as the steps', without the
    forward's and backward's spread."""
    data = _batch(rank, world_size, step)
    dist.barrier()
    started = time.perf_counter()
    _forward_backward(config, data)
    forward_backward = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    _optimizer_step(config)
    return forward_backward, time.perf_counter() - started


def floor_seconds(rank: int, world_size: int) -> float:
    """This rank's share of the blocks' matrices orthogonalized, nothing else, timed as a step
    is: once, from a barrier, while every other rank orthogonalizes its own share, so that
    ranks that share a core (W=4 on 2 cores) share it here too. Taken with the round's steps."""
    dist.barrier()
    return newton_schulz_share(_STATE["shapes"], rank, world_size)


def peak_bytes(rank: int, world_size: int, config: str, step: int) -> int:
    """The most tensor bytes live during one step of ``config`` (the memory tracker's peak:
    parameters, gradients, optimizer state, activations, communication buffers)."""
    from shardkit.tools.track.memory import MemoryTracker

    model, opts = _STATE[config]
    data = _batch(rank, world_size, step)
    with MemoryTracker(model, optimizers=opts) as tracker:
        _train_step(config, data)
    return sum(tracker.report().peak.by_category.values())


def teardown(rank: int, world_size: int) -> None:
    """Free every model, and hand the heap back (the workers outlive the measurement)."""
    _STATE.clear()
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
