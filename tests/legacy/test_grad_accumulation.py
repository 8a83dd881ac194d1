"""Gradient accumulation over microbatches, bit for bit with torch's FSDP1.

Three microbatches a step, AdamW (which turns the smallest difference in a gradient into a
visible one), three steps: accumulated without ``no_sync`` (every backward reduces), with it
(the first two do not), never zeroed at all, zeroed to zeros (``set_to_none=False``) with
``no_sync``, and one synced microbatch before an unsynced one. Two ways of FSDP1 that the
engine (torch's way) does not share, set for each unit by shardkit.legacy:

- Between backwards without sync, FSDP1's gradients accumulate in the forward's dtype
  (``param_dtype``), where torch's accumulate in the reduce dtype
  (``GroupView.accumulate_unsynced_grads_in_param_dtype``): fp16 parameters reduced in fp32.
- FSDP1's ``NO_SHARD`` (and every unit in a world of one, which FSDP1 runs as ``NO_SHARD``)
  adds a backward's gradient to the reduced one already there and reduces the sum again;
  torch's way reduces the new gradient alone and adds it: the same mean, rounded otherwise
  (``GroupView.reduce_accumulated_grads``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import (
    LegacyRun,
    full_params,
    global_loss,
    make_optimizer,
    rank_batch,
    wrap_model,
)

MICROBATCHES = 3
MODES = ("reduce_each", "no_sync", "never_zeroed", "zeroed_no_sync", "synced_first")
PRECISIONS: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "bf16": {"param_dtype": torch.bfloat16},
    "fp16_reduced_in_fp32": {"param_dtype": torch.float16, "reduce_dtype": torch.float32},
}


def _train(impl: str, run: LegacyRun, mode: str, rank: int, world_size: int) -> dict[str, Any]:
    model = wrap_model(impl, run)
    opt = make_optimizer(run, model)
    losses = []
    for step in range(run.steps):
        for micro in range(MICROBATCHES):
            last = micro == MICROBATCHES - 1
            quiet = mode in ("no_sync", "zeroed_no_sync") and not last
            quiet = quiet or (mode == "synced_first" and micro == 1)
            with model.no_sync() if quiet else contextlib.nullcontext():
                x, y = rank_batch(run, step * MICROBATCHES + micro, rank, world_size)
                loss = models.loss_of(run.model, model(x), y)
                loss.backward()
            losses.append(global_loss(loss, world_size))
        opt.step()
        if mode == "zeroed_no_sync":
            opt.zero_grad(set_to_none=False)
        elif mode != "never_zeroed":
            opt.zero_grad()
    return {"losses": losses, "params": full_params(impl, model)}


def _body(
    rank: int, world_size: int, strategies: list[str], precisions: list[str], modes: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hybrid = (2, world_size // 2) if world_size == 4 else None
    for strategy in strategies:
        for precision in precisions:
            for mode in modes:
                # Flat parameters throughout; the original ones in bf16 (FSDP1 accumulates
                # the same way with either).
                for orig in (False, True) if precision == "bf16" else (False,):
                    run = LegacyRun(
                        model="gpt",
                        strategy=strategy,
                        steps=3,
                        mixed_precision=PRECISIONS[precision],
                        optimizer="adamw",
                        extra={"use_orig_params": orig},
                        hybrid_mesh=hybrid if strategy == "HYBRID_SHARD" else None,
                    )
                    case = f"{strategy}/{precision}/{mode}/orig={orig}"
                    for impl in run.impls:
                        out[f"{impl}/{case}"] = _train(impl, run, mode, rank, world_size)
    return out


def _assert_bitwise(out: dict[str, Any]) -> None:
    cases = [key.removeprefix("torch/") for key in out if key.startswith("torch/")]
    assert cases
    for case in cases:
        ours, theirs = out[f"shardkit/{case}"], out[f"torch/{case}"]
        assert ours["losses"] == theirs["losses"], case
        assert ours["params"].keys() == theirs["params"].keys(), case
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), f"{case} {name}"


@pytest.mark.parametrize(
    ("world_size", "strategies", "precisions", "modes"),
    [
        (2, ["NO_SHARD", "FULL_SHARD"], list(PRECISIONS), list(MODES)),
        # FSDP1 runs FULL_SHARD over one rank as NO_SHARD, and so does shardkit.legacy.
        (1, ["FULL_SHARD"], list(PRECISIONS), list(MODES)),
        (4, ["HYBRID_SHARD"], ["fp16_reduced_in_fp32"], ["no_sync"]),
    ],
)
def test_accumulated_gradients_train_as_fsdp1s_bit_for_bit(
    world_size: int, strategies: list[str], precisions: list[str], modes: list[str]
) -> None:
    results = run_on_ranks(
        world_size, _body, strategies=strategies, precisions=precisions, modes=modes
    )
    for out in results:
        _assert_bitwise(out)
