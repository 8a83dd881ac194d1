"""The planner's Muon (``--optimizer muon``) against what the trackers see Muon do.

Rank r of W=4 on torch's fake group trains the 8M benchmark GPT's shapes with
``shardkit.core.optim.Muon`` on the blocks' matrices and AdamW on the rest (the planner's
``optimizer="muon"``), under the memory tracker: its optimizer state is one buffer per matrix
(AdamW's two and a step elsewhere), which the plan must give to the byte; the step's transient
(the owner's whole matrices, Newton-Schulz's temporaries, the exchanges' buffers) is an
approximation, held within 15% of the tracked peak of communication and other buffers in
the optimizer phase. The plan's exchange (two all-to-alls over the ranks, sized by the core's
routes) is the one the comm tracker sees Muon issue, to the byte, and its Newton-Schulz share
is the matrices the rank really orthogonalizes.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardkit.core.optim import Muon
from shardkit.tools.plan import PlanOptions, plan
from shardkit.tools.plan.cli import main
from shardkit.tools.plan.gpt import GPT
from shardkit.tools.plan.muon_step import MuonStep, matrices_scratch
from shardkit.tools.records import Category, Phase
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.memory import MemoryTracker
from tests.core.optim.step_counts import (
    MODELS,
    fake_rank,
    newton_schulz_flops,
    sharded_gpt,
    training_step,
)
from tests.tools.plan.plan_checks import optimizer_memory

MODEL, WORLD = "d256x8", 4


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(MODELS[MODEL])


def _tracked(rank: int) -> tuple[int, int]:
    """(optimizer state bytes, the optimizer phase's most comm + other bytes) on ``rank``."""
    with fake_rank(WORLD, rank):
        gpt = sharded_gpt(MODEL, WORLD)
        named = list(gpt.named_parameters())
        matrices = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        others = [p for n, p in named if not (p.dim() == 2 and n.startswith("blocks."))]
        opts = [Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)]
        training_step(gpt, opts, MODEL, rank)  # the optimizers' state
        with MemoryTracker(gpt, optimizers=opts) as tracker:
            training_step(gpt, opts, MODEL, rank)
    return optimizer_memory(list(tracker.report().timeline))


@pytest.mark.parametrize("rank", [0, 3])
def test_muons_state_exact_and_its_step_near_the_tracked(rank: int) -> None:
    options = PlanOptions(optimizer="muon", rank=rank, backend="gloo")
    planned = plan(_meta_gpt, world_size=WORLD, options=options)
    adamw = plan(_meta_gpt, world_size=WORLD, options=PlanOptions(rank=rank, backend="gloo"))
    state, transient = _tracked(rank)
    assert planned.memory.category_max[Category.OPTIMIZER_STATE] == state
    assert state < adamw.memory.category_max[Category.OPTIMIZER_STATE]
    step = max(
        p.by_category[Category.OTHER] for p in planned.memory.timeline if p.phase is Phase.OPTIMIZER
    )
    print(f"rank {rank}: state {state:,} bytes; step planned {step:,}, tracked {transient:,}")
    assert abs(step - transient) <= 0.15 * transient


def test_the_owner_of_the_largest_holds_its_matrices_whole() -> None:
    # Two 64 x 32 matrices and a 16 x 16 over 2 ranks, half the rows of each on each: the
    # largest first, so rank 0 owns a 64 x 32, rank 1 the other, and the 16 x 16 goes to rank
    # 0 (equal loads: the lower rank). Each rank's peak is its last matrix orthogonalized: its
    # matrices whole twice (the inputs, the updates so far; its rows are let go of once the
    # first exchange is in) and the 64 x 32's Newton-Schulz temporaries (an iterate and the
    # next, two 32 x 32 Gram products).
    matrices = [((64, 32), 32), ((64, 32), 32), ((16, 16), 8)]
    rows = (32 * 32 + 32 * 32 + 8 * 16) * 2
    newton_schulz = (2 * 64 * 32 + 2 * 32 * 32) * 2
    owned = {0: (64 * 32 + 16 * 16) * 2, 1: 64 * 32 * 2}
    for rank, whole in owned.items():
        assert matrices_scratch(matrices, rank, 2) == 2 * whole + newton_schulz
        # The other moments stay below it: the first exchange posted, the wholes joined.
        assert rows + rows // 2 + whole // 2 < 2 * whole + newton_schulz
        assert rows + whole // 2 + whole < 2 * whole + newton_schulz
    # One rank: no exchange; each matrix updated alone, beside every matrix's bf16 rows.
    alone = [((64, 32), 64), ((64, 32), 64)]
    assert matrices_scratch(alone, 0, 1) == 2 * 64 * 32 * 2 + newton_schulz


def test_shardkit_plan_takes_optimizer_muon(capsys: pytest.CaptureFixture[str]) -> None:
    factory = "shardkit.tools.examples:llama_tiny"
    assert main([factory, "--world-size", "4", "--optimizer", "muon", "--json"]) == 0
    muon = json.loads(capsys.readouterr().out)
    assert main([factory, "--world-size", "4", "--json"]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert muon["options"]["optimizer"] == "muon"
    state = "optimizer_state"
    assert 0 < muon["memory"]["category_max"][state] < adamw["memory"]["category_max"][state]


def _tracked_exchange(rank: int) -> tuple[list[tuple[str, int, int]], int, int]:
    """The optimizer phase's collectives (kind, input bytes, sent bytes) of a Muon step on
    ``rank``, the matrices it orthogonalized and their cost (``StepStats``)."""
    with fake_rank(WORLD, rank):
        gpt = sharded_gpt(MODEL, WORLD)
        named = list(gpt.named_parameters())
        matrices = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        muon = Muon(matrices, lr=0.02)
        training_step(gpt, [muon], MODEL, rank)  # the state
        with CommTracker() as comm:
            training_step(gpt, [muon], MODEL, rank)
    calls = [
        (c.kind, c.input_bytes, c.sent_bytes)
        for c in comm.rank_report().collectives
        if c.phase is Phase.OPTIMIZER
    ]
    assert muon.last_step_stats is not None
    return calls, muon.last_step_stats.updates, muon.last_step_stats.cost


@pytest.mark.parametrize("rank", [0, 3])
def test_the_plan_lists_muons_exchange_and_its_newton_schulz(rank: int) -> None:
    options = PlanOptions(optimizer="muon", rank=rank, backend="gloo")
    planned = plan(_meta_gpt, world_size=WORLD, options=options)
    calls = [
        (c.kind, c.input_bytes, c.sent_bytes)
        for c in planned.schedule
        if c.phase is Phase.OPTIMIZER
    ]
    tracked, updates, cost = _tracked_exchange(rank)
    assert calls == tracked and [k for k, _, _ in calls] == ["all_to_all"] * 2
    assert all(
        c.group == "(optimizer step)" for c in planned.schedule if c.phase is Phase.OPTIMIZER
    )
    step = _muon_step(rank)  # the matrices this rank orthogonalizes, and their FLOPs
    assert len(step.owned) == updates and sum(m * n * min(m, n) for m, n in step.owned) == cost
    assert step.flops == sum(newton_schulz_flops(s) for s in step.owned)


def _muon_step(rank: int) -> MuonStep:
    from shardkit.tools.plan.groups import build_groups
    from shardkit.tools.plan.muon_step import muon_step

    groups = build_groups(_meta_gpt(), PlanOptions(optimizer="muon", rank=rank), WORLD)
    step = muon_step(groups, len(groups) - 1, rank, 1, 0)
    assert step is not None
    return step


def test_shardkit_plan_prints_muons_share_and_exchange(capsys: pytest.CaptureFixture[str]) -> None:
    factory = "shardkit.tools.examples:llama_tiny"
    argv = [factory, "--world-size", "4", "--optimizer", "muon", "--bandwidth-gbps", "10"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # llama_tiny's 4 layers of 7 matrices over 4 ranks: 7 each, two all-to-alls.
    assert "muon step (this rank): 7 of 28 matrices orthogonalized here" in text
    assert "exchange over 4 ranks: 2 all_to_all" in text
    assert any(line.split()[:3] == ["all_to_all", "dp", "(optimizer"] for line in text.splitlines())
