"""``register_comm_hook`` against torch's FSDP1: the same hook, the same training, bit for bit.

FSDP1 hands a sharded unit's hook its padded full gradient and this rank's output, and divides
nothing itself. Three hooks at W=2: torch's ``reduce_scatter_hook`` (it divides by FSDP1's own
factors), a user hook that sends bfloat16 and scales the result, and one that rebinds
``.data`` to a float16 copy as torch's low-precision hooks do (those call ``record_stream``,
which CPU tensors lack, so they cannot run here, in FSDP1 either). ``NO_SHARD`` units, and
units of one rank (FSDP1 makes those ``NO_SHARD``), hand theirs the whole gradient to
all-reduce: torch's ``allreduce_hook`` and user hooks, at W=2 and W=1. And FSDP1's errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import (
    LegacyRun,
    assert_close_traces,
    full_params,
    make_optimizer,
    rank_batch,
    train_steps,
    wrap_model,
)


def _state() -> default_hooks.DefaultState:
    """torch's hook state over the whole world (FSDP1's process group here)."""
    world = dist.group.WORLD
    assert world is not None
    return default_hooks.DefaultState(world)


def _bf16_wire(state: default_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    sent = grad.to(torch.bfloat16)
    summed = torch.empty(output.shape, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(summed, sent, group=state.process_group)
    output.copy_(summed).div_(state.world_size)


def _rebinding(state: default_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    grad.data = grad.data.to(torch.float16)
    output.data = output.data.to(torch.float16)
    default_hooks.reduce_scatter_hook(state, grad, output)
    output.data = output.data.to(torch.float32)


def _bf16_all_reduce(state: default_hooks.DefaultState, grad: torch.Tensor) -> None:
    sent = grad.to(torch.bfloat16)
    dist.all_reduce(sent, group=state.process_group)
    grad.copy_(sent).div_(state.world_size)


def _rebinding_all_reduce(state: default_hooks.DefaultState, grad: torch.Tensor) -> None:
    grad.data = grad.data.to(torch.float16)
    default_hooks.allreduce_hook(state, grad)
    grad.data = grad.data.to(torch.float32)


HOOKS = {
    "reduce_scatter_hook": default_hooks.reduce_scatter_hook,
    "bf16_wire": _bf16_wire,
    "rebinding": _rebinding,
    "allreduce_hook": default_hooks.allreduce_hook,
    "bf16_all_reduce": _bf16_all_reduce,
    "rebinding_all_reduce": _rebinding_all_reduce,
}


def _trained(rank: int, world_size: int, hook: str, run: LegacyRun) -> dict[str, Any]:
    traces = {}
    for impl in ("shardkit", "torch"):
        model = wrap_model(impl, run)
        model.register_comm_hook(_state(), HOOKS[hook])
        losses = train_steps(model, make_optimizer(run, model), run, range(run.steps))
        traces[impl] = {"losses": losses, "params": full_params(impl, model)}
    return traces


CASES = [
    ("reduce_scatter_hook", LegacyRun()),
    ("reduce_scatter_hook", LegacyRun(strategy="SHARD_GRAD_OP", extra={"use_orig_params": True})),
    ("bf16_wire", LegacyRun(model="gpt", optimizer="adamw", steps=3)),
    ("rebinding", LegacyRun(wrap="none")),
    ("allreduce_hook", LegacyRun(strategy="NO_SHARD")),
    ("bf16_all_reduce", LegacyRun(strategy="NO_SHARD", model="gpt", optimizer="adamw", steps=3)),
    ("rebinding_all_reduce", LegacyRun(strategy="NO_SHARD", wrap="none")),
]


@pytest.mark.parametrize(("hook", "run"), CASES, ids=[f"{h}-{r.strategy}" for h, r in CASES])
def test_a_hook_trains_as_fsdp1s(hook: str, run: LegacyRun) -> None:
    for traces in run_on_ranks(2, _trained, hook=hook, run=run):
        ours, theirs = traces["shardkit"], traces["torch"]
        assert ours["losses"] == theirs["losses"]
        assert ours["params"].keys() == theirs["params"].keys()
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), name


def test_a_hook_at_four_ranks_is_fsdp1s_within_rounding() -> None:
    # The engine's rows are per-parameter shards, FSDP1's are flat chunks: past two ranks gloo
    # adds each element's four values in an order that depends on where it sits (measured:
    # parameters 1.2e-7 apart after 5 steps).
    for traces in run_on_ranks(4, _trained, hook="reduce_scatter_hook", run=LegacyRun()):
        assert_close_traces(traces["shardkit"], traces["torch"], what="W=4")


def _hook_changes_the_result(rank: int, world_size: int) -> list[float]:
    # A hook that halves every gradient: the parameters move half as far (the engine's own
    # division is off under a hook; FSDP1's is too).
    def halving(state: object, grad: torch.Tensor, output: torch.Tensor) -> None:
        default_hooks.reduce_scatter_hook(state, grad, output)  # type: ignore[arg-type]
        output.div_(2)

    moves = []
    for hook in (None, halving):
        run = LegacyRun(optimizer="plain", steps=1)
        model = wrap_model("shardkit", run)
        before = full_params("shardkit", model)
        if hook is not None:
            model.register_comm_hook(_state(), hook)
        train_steps(model, make_optimizer(run, model), run, range(1))
        after = full_params("shardkit", model)
        moves.append(sum(float((after[n] - before[n]).abs().sum()) for n in before))
    return moves


def test_the_hook_is_what_reduces() -> None:
    plain, halved = run_on_ranks(2, _hook_changes_the_result)[0]
    assert halved == pytest.approx(plain / 2, rel=1e-5)


def _errors(rank: int, world_size: int, impl: str) -> dict[str, str]:
    def message(run: LegacyRun, target: str | None, *hook: Any) -> str:
        model = wrap_model(impl, run)
        if target is not None:  # a forward decides the root (before it, any unit may be one)
            model(rank_batch(run, 0, rank, world_size)[0])
        where = model if target is None else model.get_submodule(target)
        state = _state()
        try:
            for h in hook:
                where.register_comm_hook(state, h)
        except (AssertionError, ValueError, NotImplementedError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    hook = default_hooks.reduce_scatter_hook
    return {
        "not root": message(LegacyRun(), "_fsdp_wrapped_module.blocks.0", hook),
        "twice": message(LegacyRun(), None, hook, hook),
        "not callable": message(LegacyRun(), None, "hook"),
        "hybrid": message(LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(1, 2)), None, hook),
        "no shard": message(LegacyRun(strategy="NO_SHARD"), None, default_hooks.allreduce_hook),
    }


def test_fsdp1s_errors() -> None:
    ours = run_on_ranks(2, _errors, impl="shardkit")[0]
    theirs = run_on_ranks(2, _errors, impl="torch")[0]
    for case in ("not root", "twice", "not callable", "hybrid"):
        assert ours[case] == theirs[case], case
        assert ours[case] != "no error", case
    assert ours["no shard"] == theirs["no shard"] == "no error"


ONE_RANK = [
    ("allreduce_hook", LegacyRun()),
    ("bf16_all_reduce", LegacyRun(strategy="SHARD_GRAD_OP", model="gpt", optimizer="adamw")),
]


@pytest.mark.parametrize(("hook", "run"), ONE_RANK, ids=[h for h, _ in ONE_RANK])
def test_one_rank_runs_the_hook_as_fsdp1s_no_shard(hook: str, run: LegacyRun) -> None:
    # FSDP1 turns a sharded unit of one rank into NO_SHARD and calls hook(state, grad); a
    # sharded hook's three arguments would fail there, in both.
    (traces,) = run_on_ranks(1, _trained, hook=hook, run=run)
    ours, theirs = traces["shardkit"], traces["torch"]
    assert ours["losses"] == theirs["losses"]
    for name, value in ours["params"].items():
        assert torch.equal(value, theirs["params"][name]), name


def _counted_calls(rank: int, world_size: int, strategy: str, impl: str) -> int:
    calls = 0

    def counting(state: default_hooks.DefaultState, grad: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        default_hooks.allreduce_hook(state, grad)

    run = LegacyRun(strategy=strategy, steps=2)
    model = wrap_model(impl, run)
    model.register_comm_hook(_state(), counting)
    train_steps(model, make_optimizer(run, model), run, range(run.steps))
    return calls


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "NO_SHARD"), (1, "FULL_SHARD")])
def test_the_no_shard_hook_runs_as_often_as_fsdp1s(world_size: int, strategy: str) -> None:
    # Once per unit with parameters and step, in both.
    ours = run_on_ranks(world_size, _counted_calls, strategy=strategy, impl="shardkit")
    theirs = run_on_ranks(world_size, _counted_calls, strategy=strategy, impl="torch")
    assert ours == theirs
    assert all(calls > 0 for calls in ours)
