"""What ``bench_muon.py``'s workers run: one GPT per optimizer, steps, the floor, peak memory.

Each worker builds the benchmark GPT (``gpt.build``, shardkit's ``fully_shard`` per block and
at the root) once per configuration, so that every configuration starts from the same weights
and the rounds alternate between them with nothing rebuilt:

- ``adamw``: AdamW on every parameter (the peer);
- ``muon``: shardkit's Muon on the blocks' matrices, AdamW on the rest (docs/guide/muon.md's
  groups);
- ``torch-muon``: ``torch.optim.Muon`` on the same shards, AdamW on the rest, its refusal
  bypassed (``muon_baselines.unhooked_step``): wrong, a floor;
- ``gather``: ``muon_baselines.GatherEverythingMuon``, AdamW on the rest;
- ``owner``: the owner layout's prototype (``muon_owner_layout.OwnerLayout``): the blocks'
  matrices left whole by ``fully_shard``, reduced whole onto their owners, torch's Muon there,
  all-gathered back; AdamW on the rest as in ``muon``;
- ``rows``: the same harness in FSDP's row layout with AdamW on the matrices
  (``muon_owner_layout.RowLayout``): ``owner``'s peer, the two moving the same bytes.

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
from benchmarks.muon_owner_layout import OwnerLayout, RowLayout

CONFIGS = ("adamw", "muon", "torch-muon", "gather", "owner", "rows")
LAYOUTS = ("owner", "rows")
MUON_LR = 0.02

_STATE: dict[str, Any] = {}


def takes_muon(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and name.startswith("blocks.")


def _optimizers(model: Any, config: str, adamw: torch.optim.Optimizer) -> list[Any]:
    if config == "adamw":
        return [adamw]
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if takes_muon(n, p)]
    others = [p for n, p in named if not takes_muon(n, p)]
    rest = torch.optim.AdamW(others, lr=1e-3, weight_decay=0.01)
    if config == "muon":
        from shardkit.core.optim import Muon

        return [Muon(matrices, lr=MUON_LR), rest]
    if config == "torch-muon":
        return [torch.optim.Muon([p for _, p in matrices], lr=MUON_LR), rest]
    if config == "owner":
        return [OwnerLayout([p for _, p in matrices], lr=MUON_LR), rest]
    if config == "rows":
        return [RowLayout([p for _, p in matrices]), rest]
    assert config == "gather", config
    return [GatherEverythingMuon([p for _, p in matrices], lr=MUON_LR), rest]


def setup(rank: int, world_size: int, size: str, scale: int, configs: tuple[str, ...]) -> None:
    """Build every configuration and run two warm-up steps of each."""
    _STATE.clear()
    _STATE.update(size=size, scale=scale)
    for config in configs:
        left_whole = takes_muon if config in LAYOUTS else None
        model, adamw = gpt.build("shardkit", size, world_size, left_whole=left_whole)
        _STATE[config] = (model, _optimizers(model, config, adamw))
        for step in range(2):  # lazy init, the allocator, the optimizers' state
            step_seconds(rank, world_size, config, step)
    model = _STATE[configs[0]][0]
    _STATE["shapes"] = [(p.size(0), p.size(1)) for n, p in model.named_parameters()
                        if takes_muon(n, p)]  # fmt: skip


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
    optimizers = [o for o in opts if isinstance(o, torch.optim.Optimizer)]  # not the layouts
    with MemoryTracker(model, optimizers=optimizers) as tracker:
        _train_step(config, data)
    return sum(tracker.report().peak.by_category.values())


def layout_bytes(rank: int, world_size: int, config: str) -> tuple[int, int]:
    """A layout's bytes on the wire a step, this rank (its reduce-scatter and all-gather), and
    the elements of padding in its flat buffer."""
    layout = _STATE[config][1][0]
    return layout.bytes_sent, layout.padding


def full_parameters(rank: int, world_size: int, config: str) -> dict[str, torch.Tensor]:
    """``config``'s model's parameters, whole (the layouts' matrices are whole already)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in _STATE[config][0].named_parameters()
    }


def teardown(rank: int, world_size: int) -> None:
    """Free every model, and hand the heap back (the workers outlive the measurement)."""
    _STATE.clear()
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
