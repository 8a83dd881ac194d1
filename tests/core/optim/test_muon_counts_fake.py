"""Muon's step counted on torch's fake process group at W=8 and 64: work and bytes, no numerics.

One process stands for each rank of W in turn (``step_counts.fake_rank``): the exchanges
carry the bytes they would, the rows received are whatever the buffers held, and Newton-
Schulz is a shape recorder (``step_counts.COUNTING_RULE``). On the benchmark's 35M GPT's blocks
(32 matrices) and a realistic 24 blocks of d=1024 (96 matrices of 4 shapes):

- every matrix is orthogonalized exactly once in the job (the shapes done, over all ranks,
  are the model's, and each rank's tally says as much);
- each rank's Newton-Schulz FLOPs are within 10% of the total over W where the matrices
  allow it: with whole matrices a rank's share cannot be below what pigeonholes give (W+1
  matrices on W ranks put two on one), so where the W-th and (W+1)-th largest matrices
  together exceed 1.1 x the mean that sum is the bound (96 matrices at W=64: 4/3 of the
  mean, two qkv matrices on one rank);
- the exchanges' packing and unpacking launch a few operators whatever the number of blocks
  (one ``cat`` a pack, one to join each owned matrix's rows): a GPU pays a launch for each;
- the exchange moves 4 N (W-1) / W^2 bytes a rank on average (N the matrices' elements, bf16
  rows out and bf16 update rows back), the redistributing design's figure; and a training
  step with Muon moves exactly AdamW's all-gathers and reduce-scatters plus that exchange,
  AdamW's optimizer nothing (the comm tracker's records, this rank's).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from shardkit.core.optim import WholeMatrixOptimizer, muon
from shardkit.tools.records import Phase
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.ops import OpCounter
from tests.core.optim.step_counts import (
    fake_rank,
    muon_step_count,
    newton_schulz_flops,
    optimizers,
    redistributing_bytes,
    sharded_gpt,
    training_step,
)

_POINTS = [
    ("d512x8", 8),
    pytest.param("d512x8", 64, marks=pytest.mark.slow),  # fewer matrices than ranks
    pytest.param("d1024x24", 8, marks=pytest.mark.slow),
    pytest.param("d1024x24", 64, marks=pytest.mark.slow),
]


def _flops_bound(shapes: list[tuple[int, int]], world: int) -> float:
    """The most FLOPs a rank may do: 1.1 x the mean, or the pigeonhole bound where larger."""
    flops = sorted((newton_schulz_flops(s) for s in shapes), reverse=True)
    mean = sum(flops) / world
    pigeonhole = flops[world - 1] + flops[world] if len(flops) > world else flops[0]
    return max(1.1 * mean, pigeonhole)


@pytest.mark.parametrize(("model", "world"), _POINTS)
def test_every_matrix_once_balanced_and_the_bytes_counted(model: str, world: int) -> None:
    counts = []
    for rank in range(world):
        with fake_rank(world, rank):
            count, shapes = muon_step_count(model, world)
        counts.append(count)
    done = Counter(s for c in counts for s in c.shapes)
    assert done == Counter(shapes), "every matrix once in the job, on one rank"
    assert all(c.stats.updates == len(c.shapes) for c in counts)
    assert all(c.stats.collectives == 2 for c in counts)  # rows out, updates back

    flops = [c.flops for c in counts]
    mean = sum(flops) / world
    print(
        f"{model} W={world}: {len(shapes)} matrices, Newton-Schulz {sum(flops) / 1e9:.1f} "
        f"GFLOP in all; a rank's max {max(flops) / mean:.3f}, min {min(flops) / mean:.3f} "
        "of the mean"
    )
    if len(shapes) >= world:
        assert max(flops) <= _flops_bound(shapes, world), flops
        assert min(flops) > 0, "every rank takes a share"

    sent = [c.stats.bytes_sent for c in counts]
    received = [c.stats.bytes_received for c in counts]
    assert sum(sent) == sum(received)
    figure = redistributing_bytes(shapes, world)
    print(f"  exchange: {sum(sent) / world:,.0f} bytes a rank on average (formula {figure:,.0f})")
    assert sum(sent) / world == figure


def _step_records(model: str, world: int, optimizer: str) -> tuple[dict[Phase, int], int]:
    """Rank 0's bytes sent in one training step (after a first), by phase; Muon's own tally."""
    with fake_rank(world, 0):
        gpt = sharded_gpt(model, world)
        opts = optimizers(gpt, optimizer)
        training_step(gpt, opts, model, 0)  # lazy init and the optimizers' state
        with CommTracker() as comm:
            training_step(gpt, opts, model, 0)
        stats = getattr(opts[0], "last_step_stats", None)
    by_phase: Counter[Phase] = Counter()
    for record in comm.records:
        by_phase[record.phase] += record.sent_bytes
        if record.phase is Phase.OPTIMIZER:
            assert record.kind == "all_to_all", record
    return dict(by_phase), stats.bytes_sent if stats is not None else 0


@pytest.mark.parametrize(
    ("model", "world"),
    [("d512x8", 8), pytest.param("d1024x24", 64, marks=pytest.mark.slow)],
)
def test_a_step_moves_adamws_bytes_plus_the_exchange(model: str, world: int) -> None:
    torch.manual_seed(0)
    adamw, _ = _step_records(model, world, "adamw")
    muon, exchanged = _step_records(model, world, "muon")
    assert adamw.get(Phase.OPTIMIZER, 0) == 0, "AdamW's step moves nothing"
    assert muon[Phase.OPTIMIZER] == exchanged > 0, "the tracker sees the optimizer's own bytes"
    fsdp = sum(b for phase, b in adamw.items() if phase is not Phase.OPTIMIZER)
    assert sum(b for phase, b in muon.items() if phase is not Phase.OPTIMIZER) == fsdp
    print(
        f"{model} W={world}, rank 0: FSDP {fsdp:,} bytes a step, Muon's exchange "
        f"{exchanged:,} more (+{exchanged / fsdp:.2%}); AdamW's optimizer 0"
    )


def _counted_step(world: int) -> tuple[OpCounter, int, int]:
    """Rank 0's second Muon step on the 8M GPT's blocks (32 matrices) at W: its operators,
    the matrices it owns, the matrices in all."""
    with fake_rank(world, 0):
        gpt = sharded_gpt("d256x8", world)
        for p in gpt.parameters():
            p.grad = torch.zeros_like(p)
        whole = optimizers(gpt, "muon")[0]
        whole.step()  # the state and the plan, made once
        with OpCounter() as ops:
            whole.step()
        assert isinstance(whole, WholeMatrixOptimizer) and whole.last_step_stats is not None
        matrices = sum(len(g["params"]) for g in whole.param_groups)
        return ops, whole.last_step_stats.updates, matrices


@pytest.mark.parametrize("world", [8, 64])
def test_the_moves_launch_a_few_operators_whatever_the_blocks(world: int) -> None:
    # Each block copied alone into its part and out of it, and each piece of an owned matrix
    # copied into place, was 4 dispatches a piece (at W=64 on 128 matrices about 380 copies
    # and 2,300 dispatches a step, the host's time on a GPU). Packed by one cat a part-set and
    # joined by one cat a matrix, the moves are counted in operators, not pieces.
    ops, owned, matrices = _counted_step(world)
    moved = sum(ops.by_op[name] for name in ("aten.copy_", "aten.cat", "aten.clone"))
    print(f"d256x8 W={world}, rank 0: {ops.launches} launches, {moved} of them moves, "
          f"{owned} matrices owned, {ops.total} dispatches")  # fmt: skip
    assert moved <= 2 + owned, ops.top(12)  # the two packs; each owned matrix's rows joined
    # Pieces: this rank's block of each matrix out, its update's block back, and every block
    # of each matrix it owns in. Views and slices: about two a piece, not three or four.
    pieces = 2 * matrices + owned * world
    assert ops.by_op["aten.view"] + ops.by_op["aten.slice"] <= 2.5 * pieces, ops.top(12)


@pytest.mark.parametrize("world", [8, 64])
def test_the_elementwise_parts_launch_a_few_operators_whatever_the_matrices(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's Muon runs five elementwise operators a matrix (the momentum, the nesterov blend,
    # the bf16 cast, the weight decay, the add): 160 launches a step on these 32 matrices at
    # any W, nine in ten of the step's (172 at W=8). As foreach operators they are five a
    # step, and one add more for each other adjusted learning rate (it depends on the shape:
    # three here). The path opens per device (``muon._FOREACH_DEVICES``, shut by default):
    # opened on the CPU here, as on a GPU whose check says its foreach kernels keep the bits.
    monkeypatch.setattr(muon, "_FOREACH_DEVICES", frozenset({"cpu"}))
    ops, owned, matrices = _counted_step(world)
    foreach = sum(n for name, n in ops.by_op.items() if name.startswith("aten._foreach"))
    per_tensor = sum(
        ops.by_op[name] for name in ("aten.lerp_", "aten.lerp", "aten.mul_", "aten.add_")
    )
    print(f"d256x8 W={world}, rank 0: {ops.launches} launches for {matrices} matrices, "
          f"{foreach} foreach, {per_tensor} per-tensor elementwise")  # fmt: skip
    assert per_tensor == 0, ops.top(12)
    assert foreach <= 4 + 3, ops.top(12)
    # The rest: the moves (above), the two collectives and a few buffers' zeros.
    assert ops.launches <= 2 + owned + foreach + 8, ops.top(12)
