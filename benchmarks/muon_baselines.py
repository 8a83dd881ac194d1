"""The baselines shardkit's Muon is timed against (``bench_muon.py``): benchmark code only.

- ``GatherEverythingMuon``: every rank all-gathers every whole matrix and orthogonalizes all
  of them, then keeps its rows; what a repair without owners does. Bits as Muon's (the same
  rule on the same whole matrices), W times the Newton-Schulz work, one all-gather a matrix.
- ``unhooked_step``: ``torch.optim.Muon``'s step on the same shards, past shardkit's refusal
  (the global optimizer pre-step hook of ``shardkit.core.optim.torch_muon``). It computes
  something else (row blocks through DTensor's sharded matmuls), so it is only a floor of what
  a step could cost when nothing is done about whole matrices.
- ``newton_schulz_share``: the floor that counts: this rank's share of the matrices, as
  shardkit's Muon assigns and batches them, orthogonalized with nothing else (every rank
  runs its own share at the same time, as in the step: ``muon_run.floor_seconds``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from shardkit.core.optim import MUON_RULE
from shardkit.core.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    batches_on,
    newton_schulz_cost,
    orthogonalize,
    orthogonalize_batch,
)
from shardkit.core.optim.owners import assign_owners

_MUON_DEFAULTS: dict[str, Any] = {
    "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
    "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None,
}  # fmt: skip


class GatherEverythingMuon(torch.optim.Optimizer):
    """Muon where every rank orthogonalizes every matrix: an all-gather each, no owners.

    The rule's elementwise parts (momentum, learning rate) run on rows as shardkit's do; the
    middle gathers the bf16 rows whole on every rank (DTensor's ``full_tensor``, which takes
    rows that do not divide by W) and orthogonalizes there.
    """

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, {"lr": lr, **_MUON_DEFAULTS})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        assert closure is None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)

    def _update(self, param: DTensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        grad = param.grad
        assert isinstance(grad, DTensor)
        if not state:
            state.update(MUON_RULE.init_state(grad.to_local()))
        rows = MUON_RULE.prepare(param.to_local(), grad.to_local(), state, group)
        whole = DTensor.from_local(
            rows, param.device_mesh, [Shard(0)], shape=param.shape, stride=param.stride()
        ).full_tensor()
        update = MUON_RULE.update(whole, group)
        rank = param.device_mesh.get_local_rank()
        mine = update.tensor_split(_row_bounds(param.shape[0], param.device_mesh.size()))[rank]
        MUON_RULE.apply(param.to_local(), mine, group, (param.shape[0], param.shape[1]))


def _row_bounds(rows: int, world: int) -> list[int]:
    """Where ``torch.chunk``'s row blocks start (fully_shard's Shard(0)), the first left out."""
    size = -(-rows // world)
    return [min(rows, size * r) for r in range(1, world)]


def unhooked_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without torch's global pre- and post-step hooks, shardkit's refusal too.

    torch wraps an optimizer class's ``step`` once, to run the global hooks around it, and
    keeps the step it wrapped as ``__wrapped__``: the benchmark calls that one, on purpose.
    """
    type(opt).step.__wrapped__(opt)  # type: ignore[attr-defined]


def newton_schulz_share(
    shapes: list[tuple[int, int]], rank: int, world: int, repeats: int = 1, device: str = "cpu"
) -> float:
    """Seconds to orthogonalize this rank's share of ``shapes`` alone (the fastest of
    ``repeats``), owners and batches as shardkit's Muon makes them, on random bf16 input on
    ``device`` (a CUDA device is synchronized around each repeat: its kernels are timed)."""
    costs = [newton_schulz_cost(s) for s in shapes]
    owners = assign_owners(costs, world, tall=[m > n for m, n in shapes])
    by_shape: defaultdict[tuple[int, int], int] = defaultdict(int)
    for shape, owner in zip(shapes, owners, strict=True):
        if owner == rank:
            by_shape[shape] += 1
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(n, *s, generator=gen).bfloat16().to(device) for s, n in by_shape.items()]

    def synchronize() -> None:  # a device's kernels are timed, not only their launches
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    best = float("inf")
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        for batch in inputs:
            if batch.size(0) > 1 and batches_on(batch.device):
                orthogonalize_batch(batch, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
            else:  # as the step: one at a time where batching would only loop
                for matrix in batch:
                    orthogonalize(matrix, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best
