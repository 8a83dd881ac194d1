"""Gradient clipping and FSDP1's ``ShardedGradScaler``, bit for bit with torch's FSDP1.

Where every rank holds the gradients whole (``NO_SHARD``, and every unit of a world of one),
FSDP1's clipping is reproducible to the bit: one norm per parameter it sees, a flat
parameter's being its whole flat gradient's. fp16 training goes through torch's
``ShardedGradScaler`` (unscale, clip, step, update), with an overflow on one rank at one step
(the step skipped everywhere, the scale halved). Sharded units hold other elements than
FSDP1's flat chunks on each rank, so there the norm is FSDP1's within rounding only
(``test_runtime.py``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import (
    LegacyRun,
    full_params,
    global_loss,
    rank_batch,
    wrap_model,
)

STEPS = 4
OVERFLOW_STEP = 1  # rank 0's loss is infinite there (fp16 runs)
MAX_NORM = {2.0: 0.5, math.inf: 0.1}  # below every step's norm: each step clips


def _train(impl: str, run: LegacyRun, norm_type: float, rank: int, world: int) -> dict[str, Any]:
    model = wrap_model(impl, run)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    fp16 = run.mixed_precision is not None
    scaler = ShardedGradScaler(init_scale=2.0**14, device="cpu", enabled=fp16)
    losses, norms, scales = [], [], []
    for step in range(STEPS):
        x, y = rank_batch(run, step, rank, world)
        loss = models.loss_of(run.model, model(x), y)
        if fp16 and step == OVERFLOW_STEP and rank == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(model.clip_grad_norm_(MAX_NORM[norm_type], norm_type=norm_type).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(global_loss(loss, world))
        scales.append(scaler.get_scale())
    return {"losses": losses, "norms": norms, "scales": scales, "params": full_params(impl, model)}


def _body(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fp16 in (False, True):
        for orig in (False, True):
            for norm_type in (2.0, math.inf):
                run = LegacyRun(
                    model="gpt",
                    strategy=strategy,
                    mixed_precision={"param_dtype": torch.float16} if fp16 else None,
                    extra={"use_orig_params": orig},
                )
                case = f"fp16={fp16}/orig={orig}/norm={norm_type}"
                for impl in run.impls:
                    out[f"{impl}/{case}"] = _train(impl, run, norm_type, rank, world_size)
    return out


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "NO_SHARD"), (1, "FULL_SHARD")])
def test_clipping_and_the_sharded_grad_scaler_are_fsdp1s_bit_for_bit(
    world_size: int, strategy: str
) -> None:
    # W=1: FSDP1 runs FULL_SHARD over one rank as NO_SHARD, and so does shardkit.legacy.
    for rank, out in enumerate(run_on_ranks(world_size, _body, strategy=strategy)):
        cases = [key.removeprefix("torch/") for key in out if key.startswith("torch/")]
        assert len(cases) == 8
        for case in cases:
            ours, theirs = out[f"shardkit/{case}"], out[f"torch/{case}"]
            where = f"rank {rank} {case}"
            for key in ("losses", "norms", "scales"):  # as strings: nan is nan
                assert str(ours[key]) == str(theirs[key]), f"{where} {key}"
            for name, value in ours["params"].items():
                assert torch.equal(value, theirs["params"][name]), f"{where} {name}"
            norm_type = float(case.rsplit("=", 1)[1])
            clipped = [n > MAX_NORM[norm_type] for n in ours["norms"] if math.isfinite(n)]
            assert len(clipped) >= STEPS - 1 and all(clipped), where
        if world_size == 2:  # the overflow skipped a step and halved the scale
            assert out["shardkit/fp16=True/orig=False/norm=2.0"]["scales"][OVERFLOW_STEP] == 2.0**13
