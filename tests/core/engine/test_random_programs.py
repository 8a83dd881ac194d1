"""Where a group's backward ends, tried on random programs against torch's ``fully_shard``.

Each seed is a small program (``random_programs``): blocks sharded alone, in list groups,
nested or by the root; calls in any order, some twice, with casts, views, ``.detach()``,
``no_grad`` regions and non-tensor values between them; activation checkpointing, reentrant
or not; a batch that needs a gradient or not; forward inputs cast or not. Both engines train it
at W=2 for two backwards, and every parameter's gradient on every rank is compared, its
presence and its bits (the local shard and the full tensor). The oracle is torch's engine, and
unsharded replicas where a reentrant checkpoint makes torch's wrong (``random_programs.oracle``).

The rule these guard (a group whose missing gradients are reduced as zeros ends where backward
is through the inputs of every call of it, or at the end-of-backward callback where a call had
none to watch) is [Note: post-backward trigger]'s. The rule it replaced (through the inputs of
the calls that had some: 6c7bbaf to e6d7756) dropped a gradient without a word on the first
program below; on the first 40 seeds here it raised on seeds 27 and 36 ("storage of size 0"),
gave other bits on seed 31, and left the ranks out of step on one of seeds 0 to 7 (a hang that
the pool's timeout ended).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from harness.report import RankTaskError
from tests.core.engine import random_programs
from tests.core.parity import fully_shard_of, torch_policy
from tests.core.torch_releases import INSTALLED

DEFAULT_SEEDS = range(40)  # about 5 s at W=2
SOAK_SEEDS = range(40, 640)  # about 75 s


class _TwoLinears(nn.Module):
    """torch's ``test_grouped_module_cast_forward_inputs``: a cast between a list group's two."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x).float())
        return out


def _grouped_cast_grads(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    from shardkit.core import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    if engine == "torch":
        policy = torch_policy(policy)
    fully_shard = fully_shard_of(engine)
    torch.manual_seed(0)
    model = _TwoLinears()
    fully_shard([model.a, model.b], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(2, 32)).sum().backward()
    out: dict[str, Any] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert grad is None or isinstance(grad, DTensor), name
        out[name] = None if grad is None else (grad.to_local().clone(), grad.full_tensor())
    return out


def test_a_list_group_fed_the_batch_then_a_cast_keeps_every_gradient() -> None:
    # The program: fully_shard([a, b]) with cast_forward_inputs. a's call has no input
    # to watch (the batch), b's has one (a's output, cast): the group ended at b's inputs and
    # the callback's second reduction, of a's gradient, left b's gradient None.
    ours = run_on_ranks(2, _grouped_cast_grads, engine="shardkit")
    for rank in range(2):
        assert set(ours[rank]) == {"a.weight", "b.weight"}
        assert all(grad is not None for grad in ours[rank].values()), rank
    try:
        theirs = run_on_ranks(2, _grouped_cast_grads, engine="torch")
    except RankTaskError as error:
        if INSTALLED >= (2, 13) or "expected m1 and m2 to have the same dtype" not in str(error):
            raise
        # torch's own engine cannot run the program there: a list group's inputs are cast
        # once, at its first module, so b meets fp32 with bf16 weights. shardkit's gradients
        # are checked to be there, not against torch's.
        return
    for rank in range(2):
        for name, want in theirs[rank].items():
            got = ours[rank][name]
            assert want is not None and got is not None, (rank, name, got)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (rank, name)


def _check(seeds: range) -> None:
    results = run_on_ranks(2, random_programs.check_seeds, seeds=list(seeds), timeout_s=600)
    refused: list[str] = []
    problems: list[str] = []
    for per_rank in results:
        for seed, lines in per_rank.items():
            if seed == -1:
                refused = lines
            else:
                problems.extend(lines)
    assert not problems, "\n".join(problems)
    # Both engines refuse a program whose loss has no gradient (every output cut off):
    # a few seeds in a hundred; more would mean the generator tests little.
    assert len(refused) <= max(2, len(seeds) // 50), refused


def test_random_programs_give_torch_s_gradients() -> None:
    _check(DEFAULT_SEEDS)


@pytest.mark.slow
def test_random_programs_give_torch_s_gradients_soak() -> None:
    _check(SOAK_SEEDS)


def test_the_generator_makes_every_shape() -> None:
    # The seeds of the default run cover every feature, and their oracle is torch's mostly.
    programs = [random_programs.generate(s) for s in DEFAULT_SEEDS]
    calls = [c for p in programs for c in p.calls]
    assert {c.edge for c in calls} == set(random_programs.EDGES)
    assert {c.checkpoint for c in calls} == set(random_programs.CHECKPOINTS)
    assert {s for p in programs for s in p.sharding} == set(random_programs.SHARDINGS)
    assert {p.policy for p in programs} == set(random_programs.POLICIES)
    assert any(len({c.block for c in p.calls}) < len(p.calls) for p in programs)  # used twice
    assert {p.batch_needs_grad for p in programs} == {True, False}
    assert sum(random_programs.oracle(p) == "torch" for p in programs) >= len(programs) * 2 // 3
    assert random_programs.generate(7) == random_programs.generate(7)
