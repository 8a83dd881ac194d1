"""HSDP gradient accumulation as OLMo-core drives it: the last backward and the all-reduce
toggled together per micro-batch, against torch's ``fully_shard`` bit for bit.

OLMo-core's trainer calls ``set_is_last_backward(last)`` and ``set_requires_all_reduce(last)``
before each micro-batch's backward. A reduction still in flight when a non-last backward ends
(the root's, holding the embeddings) then finishes in the next backward, after the switch
changed: it must finish as it was issued, deferring its all-reduce, or the replicas sum each
deferred micro-batch once more than torch does and in another order (the grad norm differed in
its seventh digit). Each case compares losses, grad norms, gradients, parameters and the
collectives torch's ``CommDebugMode`` counts, step by step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import fully_shard_of

_STEPS = 3
_PER_MICROBATCH = 2  # rows of each rank's micro-batch


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(impl: str, rank: int, world_size: int, microbatches: int) -> dict[str, Any]:
    """OLMo-core's loop: per block and root ``fully_shard`` on a (replicate, shard) mesh."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = models.build("gpt")
    fully_shard = fully_shard_of(impl)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": [], "counts": []}
    for step in range(_STEPS):
        x, y = models.batch("gpt", step, world_size * microbatches * _PER_MICROBATCH)
        xs = x.chunk(world_size)[rank].chunk(microbatches)
        ys = y.chunk(world_size)[rank].chunk(microbatches)
        counts: Counter[str] = Counter()
        for micro in range(microbatches):
            last = micro == microbatches - 1
            model.set_is_last_backward(last)
            model.set_requires_all_reduce(last)
            # One mode per forward and backward: torch's mode loses its module stack on a
            # second forward within one.
            with CommDebugMode() as mode:
                loss = models.loss_of("gpt", model(xs[micro]), ys[micro]) / microbatches
                loss.backward()
            counts.update({str(op): n for op, n in mode.get_comm_counts().items()})
            out["losses"].append(loss.detach().clone())
        out["counts"].append(counts)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        out["norms"].append(_full(norm))
        out["grads"].append([_full(p.grad) for p in model.parameters()])
        optim.step()
        optim.zero_grad()
    out["params"] = [_full(p) for p in model.parameters()]
    return out


def _both_engines(rank: int, world_size: int, microbatches: int) -> dict[str, Any]:
    ours = _train("shardkit", rank, world_size, microbatches)
    theirs = _train("torch", rank, world_size, microbatches)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b)

    verdict = {key: same(ours[key], theirs[key]) for key in ours}
    return {"same": verdict, "counts": (ours["counts"], theirs["counts"])}


@pytest.mark.parametrize("microbatches", [2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_last_backward_and_all_reduce_toggled_together_give_torchs_bits(
    world_size: int, microbatches: int
) -> None:
    for rank, result in enumerate(
        run_on_ranks(world_size, _both_engines, microbatches=microbatches)
    ):
        ours, theirs = result["counts"]
        # The oracle counted at all: one all-reduce across replicas per group and step.
        assert all(c["c10d_functional.all_reduce"] or c["c10d.allreduce_"] for c in theirs), theirs
        assert result["same"]["counts"], (rank, ours, theirs)
        assert all(result["same"].values()), (rank, result["same"])
