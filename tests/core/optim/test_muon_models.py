"""Muon on whole models and every mesh of issue 83: torch's Muon's bits, 10 steps, each engine.

The demo's GPT and a transformers Qwen2 on FSDP at W=2 and 4, HSDP 2 x 2 and FSDP x TP 2 x 2;
transformers' Mixtral and Qwen2-MoE (experts as 3-D stacks) on FSDP at W=2 and 4 and HSDP
2 x 2, and under FSDP x TP 2 x 2 (attention cut by TP; a known limitation there, see its
test); the demo's GPT and Qwen2 with accumulated gradients and with bf16 parameters (fp32
reduce) at W=4, on FSDP, HSDP and FSDP x TP (see ``model_runs``). Each matrix (each expert) is
orthogonalized once in the job: the updates of all ranks' last step sum to the matrices Muon
has.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.model_runs import Case, compare_body

pytest.importorskip("transformers")

STEPS = 10

# (case, world size); ids "<model>-<layout><W>"
MESHES = [
    (Case(model=model, layout=layout), world)
    for model in ("demo_gpt", "qwen2")
    for layout, world in (("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 4))
] + [
    (Case(model=model, layout=layout), world)
    for model in ("mixtral", "qwen2_moe")
    for layout, world in (("fsdp", 2), ("fsdp", 4), ("hsdp", 4))
]
PATHS = [
    (Case(model=model, layout=layout, **path), 4)
    for model in ("demo_gpt", "qwen2")
    for layout in ("fsdp", "hsdp")
    for path in ({"micro": 3}, {"bf16_params": True})
] + [
    # Under FSDP x TP 2 x 2 too; the demo's own parallelize takes no mixed-precision policy.
    (Case(model="demo_gpt", layout="tp", micro=3), 4),
    (Case(model="qwen2", layout="tp", micro=3), 4),
    (Case(model="qwen2", layout="tp", bf16_params=True), 4),
]


def _id(case: Case, world: int) -> str:
    path = "-accumulate" if case.micro > 1 else "-bf16-params" if case.bf16_params else ""
    return f"{case.model}-{case.layout}{world}{path}"


def _check(results: list[dict[str, Any]], repeated: int = 0) -> None:
    """Bit for bit every step; every matrix orthogonalized once in the job, ``repeated`` of
    them once more."""
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
    for step in range(STEPS):
        done = sum(out["stats"][step][0] for out in results)
        assert done == results[0]["matrices"] + repeated


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize(("case", "world"), [pytest.param(*c, id=_id(*c)) for c in MESHES])
def test_ten_steps_bit_for_bit_on_each_mesh(case: Case, world: int, impl: str) -> None:
    results = run_on_ranks(world, compare_body, impl=impl, case=case, steps=STEPS)
    assert results[0]["dp_only"] == 0  # under TP: every matrix of the two cut by TP too
    _check(results)


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_moe_under_fsdp_x_tp_repeats_the_matrices_tp_leaves_whole(model: str, impl: str) -> None:
    # Known limitation. TP's plan cuts the attention's projections; the expert stacks, the
    # routers and Qwen2-MoE's shared expert take no torch style and are FSDP's alone: DTensors
    # of the dp axis, one per TP rank's dp group. Nothing in their placements says that the
    # groups hold the same values (pipeline stages on sibling slices hold different ones), so
    # each group orthogonalizes them: tp (2) times in the job. The bits stay a single
    # process's; the work on those matrices is doubled.
    case = Case(model=model, layout="tp")
    results = run_on_ranks(4, compare_body, impl=impl, case=case, steps=STEPS)
    assert 0 < results[0]["dp_only"] < results[0]["matrices"]
    _check(results, repeated=results[0]["dp_only"])


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_moe_under_fsdp_x_tp_told_the_tp_axis_orthogonalizes_each_matrix_once(
    model: str, impl: str
) -> None:
    # The fix of the limitation above: Muon(..., replicated_over=mesh["tp"]) takes the
    # matrices TP leaves whole as replicated on the TP axis too, so one rank of the 2 x 2 mesh
    # owns each; the same bits, each matrix once in the job.
    case = Case(model=model, layout="tp", replicated_over=True)
    results = run_on_ranks(4, compare_body, impl=impl, case=case, steps=STEPS)
    assert 0 < results[0]["dp_only"] < results[0]["matrices"]
    _check(results)


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize(("case", "world"), [pytest.param(*c, id=_id(*c)) for c in PATHS])
def test_ten_steps_bit_for_bit_on_each_training_path(case: Case, world: int, impl: str) -> None:
    _check(run_on_ranks(world, compare_body, impl=impl, case=case, steps=STEPS))


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_one_muon_with_adamw_keeps_the_bits_on_hsdp_and_fsdp_x_tp(layout: str, impl: str) -> None:
    # MuonWithAdamW in place of the pair, on the meshes whose placements Muon works hardest
    # for: the same ten steps of torch's Muon and AdamW, every matrix once in the job.
    case = Case(model="qwen2", layout=layout, one=True)
    _check(run_on_ranks(4, compare_body, impl=impl, case=case, steps=STEPS))
