"""Muon's step counted on real ranks (gloo, W=2 and 4): work and bytes, as on the fake group.

The fake group's counts (``test_muon_counts_fake.py``) again, where the bytes really cross a
wire: every matrix of the 8M benchmark GPT's blocks orthogonalized once in the job, each rank's
Newton-Schulz FLOPs within 10% of the mean, the exchange's bytes the redistributing figure
(4 N (W-1) / W^2 a rank on average), and a training step with Muon moving AdamW's bytes plus
the exchange, as the comm tracker records them on every rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.tools.records import Phase
from shardkit.tools.track.comm import CommTracker
from tests.core.optim.step_counts import (
    muon_step_count,
    optimizers,
    redistributing_bytes,
    sharded_gpt,
    training_step,
)

MODEL = "d256x8"


def _bytes_by_phase(rank: int, world: int, optimizer: str) -> tuple[int, int, int]:
    """(FSDP's bytes, the optimizer phase's, the optimizer's own tally) of one tracked step."""
    torch.manual_seed(0)
    gpt = sharded_gpt(MODEL, world)
    opts = optimizers(gpt, optimizer)
    training_step(gpt, opts, MODEL, rank)  # lazy init and the optimizers' state
    with CommTracker() as comm:
        training_step(gpt, opts, MODEL, rank)
    stats = getattr(opts[0], "last_step_stats", None)
    step = sum(r.sent_bytes for r in comm.records if r.phase is Phase.OPTIMIZER)
    fsdp = sum(r.sent_bytes for r in comm.records if r.phase is not Phase.OPTIMIZER)
    return fsdp, step, stats.bytes_sent if stats is not None else 0


def _counts_body(rank: int, world_size: int) -> dict[str, Any]:
    count, shapes = muon_step_count(MODEL, world_size)
    return {
        "shapes": shapes,
        "done": count.shapes,
        "flops": count.flops,
        "stats": count.stats,
        "adamw": _bytes_by_phase(rank, world_size, "adamw"),
        "muon": _bytes_by_phase(rank, world_size, "muon"),
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_counts_on_real_ranks(world: int) -> None:
    results = run_on_ranks(world, _counts_body)
    shapes = results[0]["shapes"]
    assert Counter(s for r in results for s in r["done"]) == Counter(shapes)
    flops = [r["flops"] for r in results]
    mean = sum(flops) / world
    assert max(flops) <= 1.1 * mean and min(flops) >= 0.9 * mean, flops
    sent = sum(r["stats"].bytes_sent for r in results)
    assert sent == sum(r["stats"].bytes_received for r in results)
    assert sent / world == redistributing_bytes(shapes, world)
    for r in results:
        (fsdp_adamw, step_adamw, _), (fsdp_muon, step_muon, tally) = r["adamw"], r["muon"]
        assert step_adamw == 0 and fsdp_muon == fsdp_adamw
        assert step_muon == tally == r["stats"].bytes_sent  # the same owners every step
    print(
        f"W={world}: FSDP {results[0]['adamw'][0]:,} bytes a rank a step; Muon's exchange "
        f"{sent / world:,.0f} more on average; Newton-Schulz {max(flops) / mean:.3f} of the mean"
    )
