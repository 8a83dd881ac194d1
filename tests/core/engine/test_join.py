"""Uneven inputs through torch's ``Join``: a rank out of batches shadows the others' steps.

The oracle is unsharded replicas (``tests.core.replica_oracle``, set up by
``join_helpers.replicas``): on every rank a plain copy of the model (same seed) trained on every
rank's batches, each iteration's gradient the sum of the gradients of the ranks that had a
batch then, divided by the initial world size (``divide_by_initial_world_size=True``) or by
the number of those ranks. Every rank computes it alone: each rank's batches follow from the
iteration and the rank. torch's own ``fully_shard`` is the control: its modules are not
joinable.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.engine.join_helpers import ATOL, RTOL, RecordingSGD, oracle, recorded, replicas
from tests.core.engine.join_helpers import assert_matches_oracle as _assert_matches_oracle
from tests.core.engine.join_helpers import batch as _batch
from tests.core.engine.join_helpers import loss as _loss
from tests.core.engine.join_helpers import sharded as _sharded
from tests.core.engine.join_helpers import syncs as _syncs
from tests.core.parity import full_params, fully_shard_of
from tests.core.replica_oracle import ReplicaTraining, Turn, plain, sgd, train_replicas


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return RecordingSGD(params)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def _iterate(
    name: str,
    model: Any,
    optimizer: torch.optim.Optimizer,
    step: int,
    rank: int,
    world_size: int,
    *,
    accumulate: bool,
) -> None:
    x, y = _batch(name, step, rank, world_size)
    syncs = _syncs(step, accumulate)
    model.set_requires_gradient_sync(syncs)
    _loss(name, model(x), y).backward()
    if syncs:
        optimizer.step()
        optimizer.zero_grad()


def _join_body(
    rank: int,
    world_size: int,
    counts: list[int],
    opt: str,
    accumulate: bool = False,
    divide_initial: bool = True,
    mesh_shape: tuple[int, ...] | None = None,
    name: str = "mlp",
    explicit_prefetch: bool = False,
    scheduler: bool = False,
    bf16: bool = False,
) -> dict[str, Any]:
    model = _sharded(world_size, mesh_shape or (world_size,), name, bf16)
    if explicit_prefetch:
        blocks = list(model.blocks)
        for before, after in itertools.pairwise(blocks):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
        model.set_reduce_scatter_max_input_buffers(2)
    optimizer = _optimizer(opt, model.parameters())
    schedule = _scheduler(optimizer) if scheduler else None
    join = Join(
        [model],
        optimizer=optimizer,
        divide_by_initial_world_size=divide_initial,
        lr_scheduler=schedule,
    )
    with join:
        for step in range(counts[rank]):
            _iterate(name, model, optimizer, step, rank, world_size, accumulate=accumulate)
            if schedule is not None and _syncs(step, accumulate):
                schedule.step()
    training = replace(
        replicas(name, world_size, counts, accumulate=accumulate),
        optimizer=lambda plain: _optimizer(opt, plain.parameters()),
        divide_by_active_ranks=not divide_initial,
        scheduler=_scheduler if scheduler else None,
    )
    expected = oracle(training)
    return {"params": full_params(model), "grads": recorded(optimizer), "expected": expected}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("counts", [[4, 2], [5, 0], [1, 3]])
def test_uneven_batches_match_the_oracle(counts: list[int], opt: str) -> None:
    _assert_matches_oracle(run_on_ranks(2, _join_body, counts=counts, opt=opt))


@pytest.mark.parametrize("counts", [[3, 1], [3, 0]])
@pytest.mark.parametrize("name", ["head_root", "gpt_tied", "mlp_frozen"])
def test_other_model_shapes(name: str, counts: list[int]) -> None:
    """Where the root's backward ends, first or last, a rank that never ran must guess too."""
    results = run_on_ranks(2, _join_body, counts=counts, opt="adamw", name=name)
    _assert_matches_oracle(results)


@pytest.mark.parametrize("counts", [[4, 2], [4, 0]])
def test_explicit_prefetch_and_reductions_in_flight(counts: list[int]) -> None:
    """Prefetching and reductions left in flight change the order the collectives go out in."""
    results = run_on_ranks(2, _join_body, counts=counts, opt="sgd", explicit_prefetch=True)
    _assert_matches_oracle(results)


def test_the_joined_rank_steps_the_lr_scheduler() -> None:
    results = run_on_ranks(2, _join_body, counts=[4, 1], opt="sgd", scheduler=True)
    _assert_matches_oracle(results)


@pytest.mark.parametrize("counts", [[3, 1], [3, 0]])
def test_mixed_precision(counts: list[int]) -> None:
    """bf16 parameters, fp32 reductions: the joined rank's zeros are cast as gradients are."""
    results = run_on_ranks(2, _join_body, counts=counts, opt="sgd", bf16=True)
    # bf16's forward and backward against fp32's.
    _assert_matches_oracle(results, rtol=2e-2, atol=2e-3, grad_tolerances=(5e-2, 1e-2))


def test_divide_by_active_ranks() -> None:
    results = run_on_ranks(2, _join_body, counts=[4, 2], opt="sgd", divide_initial=False)
    _assert_matches_oracle(results)


@pytest.mark.parametrize("counts", [[4, 2], [6, 0], [4, 3]])
def test_gradient_accumulation(counts: list[int]) -> None:
    """[4, 3]: rank 1 joins inside a window; its first micro-batch's gradient still counts."""
    results = run_on_ranks(2, _join_body, counts=counts, opt="adamw", accumulate=True)
    _assert_matches_oracle(results)


def test_hsdp_uneven() -> None:
    results = run_on_ranks(4, _join_body, counts=[3, 1, 2, 0], opt="adamw", mesh_shape=(2, 2))
    _assert_matches_oracle(results)


def _trace_body(rank: int, world_size: int, name: str) -> dict[str, list[tuple[str, str, int]]]:
    from shardkit.core.engine.state_registry import state_of
    from shardkit.core.engine.step_ops import EngineOps
    from shardkit.core.engine.step_trace import StepTrace, tree_trace

    model = _sharded(world_size, (world_size,), name)
    x, y = _batch(name, 0, rank, world_size)
    state = state_of(model)
    state.lazy_init()
    assert state.ctx is not None and isinstance(state.ctx.driver.ops, EngineOps)
    recorded = state.ctx.driver.ops.trace = StepTrace()
    _loss(name, model(x), y).backward()

    def listed(trace: StepTrace) -> list[tuple[str, str, int]]:
        return [(e.kind, e.group.fqn, len(e.grads or ())) for e in trace.events]

    return {"recorded": listed(recorded), "derived": listed(tree_trace(model, state.ctx.states))}


@pytest.mark.parametrize("name", ["mlp", "head_root", "gpt_tied", "mlp_frozen"])
def test_the_module_tree_gives_the_recorded_order(name: str) -> None:
    """What a rank that never ran replays is what a real iteration records."""
    result = run_on_ranks(2, _trace_body, name=name)[0]
    assert result["derived"] == result["recorded"]


# --- throw_on_early_termination, and nothing left behind -------------------------------------


def _count_all_reduces(fn: Callable[[], None]) -> int:
    calls = 0
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        fn()
    finally:
        dist.all_reduce = original
    return calls


def _throw_body(rank: int, world_size: int) -> dict[str, Any]:
    model = _sharded(world_size, (world_size,))
    optimizer = _optimizer("sgd", model.parameters())
    message = ""
    try:
        with Join([model], throw_on_early_termination=True, optimizer=optimizer):
            for step in range(3 if rank == 0 else 1):
                _iterate("mlp", model, optimizer, step, rank, world_size, accumulate=False)
    except RuntimeError as error:
        message = str(error)
    # The Join is over on every rank: an iteration issues the engine's collectives only.
    after = _count_all_reduces(
        lambda: _iterate("mlp", model, optimizer, 5, rank, world_size, accumulate=False)
    )
    return {"message": message, "all_reduces_after": after}


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    results = run_on_ranks(2, _throw_body)
    assert "exhausted" in results[0]["message"]  # the one still running: "Detected ..."
    assert "Rank 1 exhausted all inputs" in results[1]["message"]
    assert [r["all_reduces_after"] for r in results] == [0, 0]


def _after_join_body(rank: int, world_size: int) -> dict[str, int]:
    model = _sharded(world_size, (world_size,))
    optimizer = _optimizer("sgd", model.parameters())
    during = 0
    with Join([model], optimizer=optimizer):
        for step in range(2 if rank == 0 else 1):
            one = functools.partial(_iterate, "mlp", model, optimizer, step, rank, world_size)
            during += _count_all_reduces(functools.partial(one, accumulate=False))
    after = _count_all_reduces(
        lambda: _iterate("mlp", model, optimizer, 3, rank, world_size, accumulate=False)
    )
    return {"during": during, "after": after}


def test_an_ended_join_costs_no_collective() -> None:
    results = run_on_ranks(2, _after_join_body)
    # While active, an iteration adds torch's notification and the agreement: two all-reduces.
    # Rank 0's second iteration, rank 1 out of batches, announces its optimizer step too:
    # a header and the scale factors, two more.
    assert results[0]["during"] == 6 and results[1]["during"] == 2
    assert [r["after"] for r in results] == [0, 0]


# --- errors, and the control ------------------------------------------------------------------


def _errors_body(rank: int, world_size: int) -> dict[str, str]:
    model = _sharded(world_size, (world_size,))
    optimizer = _optimizer("sgd", model.parameters())
    x, y = _batch("mlp", 0, rank, world_size)
    _loss("mlp", model(x), y).backward()  # the root is known from here on
    found: dict[str, str] = {}
    attempts: dict[str, Callable[[], Any]] = {
        "non_root": lambda: Join([model.blocks[0]], optimizer=optimizer),
        "no_optimizer": lambda: Join([model]),
        "not_an_optimizer": lambda: Join([model], optimizer=lambda: None),
        "not_a_scheduler": lambda: Join([model], optimizer=optimizer, lr_scheduler=3),
        "other_params": lambda: Join(
            [model], optimizer=torch.optim.SGD(model.blocks[0].parameters(), lr=0.1)
        ),
    }
    for label, attempt in attempts.items():
        try:
            attempt()
        except (RuntimeError, ValueError, TypeError) as error:
            found[label] = f"{type(error).__name__}: {error}"
    return found


def test_misuse_raises_naming_the_module() -> None:
    found = run_on_ranks(1, _errors_body)[0]
    assert found["non_root"].startswith("RuntimeError") and "blocks.0" in found["non_root"]
    assert found["no_optimizer"].startswith("ValueError") and "MLPNet" in found["no_optimizer"]
    assert found["not_an_optimizer"].startswith("TypeError")
    assert "function" in found["not_an_optimizer"]
    assert found["not_a_scheduler"].startswith("TypeError") and "int" in found["not_a_scheduler"]
    assert found["other_params"].startswith("ValueError") and "inp.weight" in found["other_params"]


def _torch_body(rank: int, world_size: int) -> str:
    model = models.build("mlp")
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard_of("torch")(model, mesh=mesh)
    try:
        Join([model], optimizer=_optimizer("sgd", model.parameters()))
    except AttributeError as error:
        return str(error)
    return ""


def test_torch_fully_shard_is_not_joinable() -> None:
    assert "join_hook" in run_on_ranks(2, _torch_body)[0]


def test_a_model_without_join_is_not_joined() -> None:
    from shardkit.core import FSDPModule

    module: Any = nn.Linear(2, 2)
    assert not hasattr(module, "join_hook")
    assert FSDPModule._join_config.enable is False


def _eval_body(rank: int, world_size: int, counts: list[int]) -> dict[str, Any]:
    """Train a step under a Join, then evaluate uneven numbers of batches under another."""
    model = _sharded(world_size, (world_size,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], optimizer=optimizer):
        _iterate("mlp", model, optimizer, 0, rank, world_size, accumulate=False)
    outputs = []
    with Join([model], optimizer=optimizer), torch.no_grad():
        for step in range(counts[rank]):
            x, _ = _batch("mlp", 10 + step, rank, world_size)
            outputs.append(model(x))
    # The oracle: the same step on every rank's batch, then the forwards.
    trained = train_replicas(
        replace(replicas("mlp", world_size, [1] * world_size), optimizer=sgd(0.1))
    ).model
    with torch.no_grad():
        expected = [
            trained(_batch("mlp", 10 + s, rank, world_size)[0]) for s in range(counts[rank])
        ]
    return {"outputs": outputs, "expected": expected}


@pytest.mark.parametrize("counts", [[5, 3], [2, 0]])
def test_an_evaluation_loop_with_uneven_batches(counts: list[int]) -> None:
    # The joined rank shadows each evaluation forward's gathers (and its step check): no hang,
    # and every output is the unsharded model's.
    for result in run_on_ranks(2, _eval_body, counts=counts):
        assert len(result["outputs"]) == len(result["expected"])
        for got, want in zip(result["outputs"], result["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_gradient_accumulation_under_hsdp() -> None:
    """Accumulation windows cut short by a rank out of batches, on a 2 x 2 mesh."""
    results = run_on_ranks(
        4, _join_body, counts=[4, 2, 3, 0], opt="adamw", accumulate=True, mesh_shape=(2, 2)
    )
    _assert_matches_oracle(results)


# --- a conditional module under Join ----------------------------------------------------------


def _tower_model() -> models.Tower:
    torch.manual_seed(0)
    return models.Tower(6, 3)


def _tower_step(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 6, generator=generator)
    out: torch.Tensor = model(x, (step + rank) % 2 == 0)  # ranks take turns skipping the tower
    return out.pow(2).mean()


def _conditional_body(rank: int, world_size: int, counts: list[int]) -> dict[str, Any]:
    from shardkit.core import fully_shard

    model: Any = _tower_model()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.tower, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.tower.set_conditional(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], optimizer=optimizer):
        for step in range(counts[rank]):
            _tower_step(model, rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = train_replicas(_tower_replicas(world_size, counts)).params
    return {"params": plain(dict(model.named_parameters())), "expected": expected}


def _tower_replicas(world_size: int, counts: list[int]) -> ReplicaTraining:
    def loss(model: nn.Module, turn: Turn) -> torch.Tensor | None:
        if turn.step >= counts[turn.rank]:
            return None  # out of batches
        return _tower_step(model, turn.rank, turn.step)

    return ReplicaTraining(
        make_model=_tower_model,
        loss=loss,
        world_size=world_size,
        steps=max(counts),
        optimizer=sgd(0.1),
    )


@pytest.mark.parametrize("counts", [[4, 2], [3, 0]])
def test_a_conditional_module_under_join(counts: list[int]) -> None:
    """The tower's collectives are its anchor's: the joined rank's shadow issues them too."""
    for rank, result in enumerate(run_on_ranks(2, _conditional_body, counts=counts)):
        for name, value in result["params"].items():
            torch.testing.assert_close(
                value, result["expected"][name], rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {name}"
            )
