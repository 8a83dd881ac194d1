"""Conditional modules (``set_conditional``): skipped on some ranks, or run in another order.

The oracle is unsharded replicas (``tests.core.replica_oracle``): every rank builds a plain
copy of the model (same seed) and runs each rank's batch with that rank's control flow, one
after another; a parameter's gradient is the mean over ranks of each rank's own (zeros where
a rank did not use it), and plain SGD steps the copy. shardkit's first-step gradients and its
parameters after three SGD steps must match it within fp32 rounding. torch's ``fully_shard``
runs beside on the tower and the swapped blocks as the control: what it does there is
recorded, not required.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shardkit.core import FSDPModule, MixedPrecisionPolicy
from tests.core import models
from tests.core.parity import full_params, fully_shard_of, torch_policy
from tests.core.replica_oracle import ReplicaTraining, Turn, sgd, train_replicas

DIM = 8
LR = 0.1
STEPS = 3
EXPERTS = 3


# --- the models and each rank's control flow ---------------------------------------------


class Stack(nn.Module):
    """Four blocks and a head (cases 2 and 3: early exit, swapped order)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.Block(DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for index in order:
            x = self.blocks[index](x)
        out: torch.Tensor = self.head(x)
        return out


class Experts(nn.Module):
    """A trunk, experts chosen per token by the data (argmax of its first columns), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(models.Block(DIM) for _ in range(EXPERTS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, recompute: bool) -> torch.Tensor:
        h = self.trunk(x)
        route = x[:, :EXPERTS].argmax(dim=1)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero().flatten()
            if rows.numel() == 0:
                continue  # no tokens: this rank does not call the expert at all
            tokens = h[rows]
            y = checkpoint(expert, tokens, use_reentrant=False) if recompute else expert(tokens)
            mixed = mixed.index_add(0, rows, y)
        out: torch.Tensor = self.head(h + mixed)
        return out


class MoELayer(nn.Module):
    """Experts, then a projection of its own: the experts' anchor (case 4, inner anchors).

    Its own parameters get their gradients before its experts' do: its backward must not end
    at its count, but once backward is through its inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(models.Block(DIM) for _ in range(EXPERTS))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        mixed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero().flatten()
            if rows.numel() == 0:
                continue
            mixed = mixed.index_add(0, rows, checkpoint(expert, x[rows], use_reentrant=False))
        out: torch.Tensor = self.proj(x + mixed)
        return out


class MoE(nn.Module):
    """Two MoE layers and a head. The first layer's input needs no gradient (the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, recompute: bool) -> torch.Tensor:
        route = x[:, :EXPERTS].argmax(dim=1)
        for layer in self.layers:
            x = checkpoint(layer, x, route, use_reentrant=False) if recompute else layer(x, route)
        out: torch.Tensor = self.head(x)
        return out


@dataclass(frozen=True, kw_only=True)
class Case:
    """One experiment: which model, which control flow, which settings."""

    name: str
    world: int = 2
    hsdp: bool = False
    reshard: bool | int | None = None  # reshard_after_forward of every non-root call
    bf16: bool = False
    accumulate: bool = False  # two micro-batches a step, the first without gradient sync
    prefetch: bool = True  # explicit forward/backward prefetch between unmarked groups
    bare_root: bool = False  # the head sharded by a call of its own: the root holds nothing
    unused: bool = False  # the tower: no rank runs it (zeros everywhere)
    evaluate: bool = False  # a no_grad forward between steps
    recompute_layers: bool = False  # moe: activation checkpointing around each layer too
    nested: bool = False  # tower: its linears sharded by calls of their own, marked through it


def _build(case: Case) -> nn.Module:
    torch.manual_seed(11)
    if case.name == "tower":
        return models.Tower(DIM, DIM)  # text, a tower only some batches use, a head (case 1)
    if case.name == "experts":
        return Experts()
    if case.name == "moe":
        return MoE()
    return Stack(4 if case.name == "early_exit" else 2)


def _marked(case: Case, model: Any) -> list[nn.Module]:
    if case.name == "tower":
        return [model.tower]
    if case.name == "early_exit":
        return [model.blocks[2], model.blocks[3]]
    if case.name == "swap":
        return list(model.blocks)
    if case.name == "moe":
        return [expert for layer in model.layers for expert in layer.experts]
    return list(model.experts)


def _sharded(case: Case, model: Any) -> list[nn.Module]:
    """The modules sharded by their own call, before the root's."""
    if case.name == "tower" and case.nested:
        return [model.text, model.tower.fc1, model.tower.fc2, model.tower]
    if case.name == "tower":
        return [model.text, model.tower]
    if case.name == "experts":
        return [model.trunk, *model.experts]
    if case.name == "moe":
        return [*_marked(case, model), *model.layers]
    return [*model.blocks, model.head] if case.bare_root else list(model.blocks)


def _forward(case: Case, model: Any, x: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    """Rank ``rank``'s control flow on micro-batch ``micro``."""
    flip = (rank + micro) % 2  # the accumulation cases switch roles between micro-batches
    if case.name == "tower":
        return model(x, use_tower=flip == 0 and not case.unused)  # type: ignore[no-any-return]
    if case.name == "early_exit":
        return model(x, order=[0, 1, 2, 3] if flip == 0 else [0, 1])  # type: ignore[no-any-return]
    if case.name == "swap":
        return model(x, order=[0, 1] if flip == 0 else [1, 0])  # type: ignore[no-any-return]
    if case.name == "moe":
        return model(x, recompute=case.recompute_layers)  # type: ignore[no-any-return]
    return model(x, recompute=True)  # type: ignore[no-any-return]


def _batch(case: Case, step: int, rank: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(4, DIM, generator=generator)
    if case.name in ("experts", "moe"):
        # Route by data: each rank's tokens go to two of the three experts, a different pair
        # per rank and step, so an expert gets no tokens on some ranks.
        allowed = [(rank + step) % EXPERTS, (rank + step + 1) % EXPERTS]
        for row in range(x.shape[0]):
            x[row, allowed[row % 2]] += 3.0
    return x


def _micro_batches(case: Case) -> int:
    return 2 if case.accumulate else 1


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


# --- the oracle: unsharded replicas ----------------------------------------------------------


def _oracle(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """First-step gradients (of the parameters some rank used) and final parameters."""

    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        x = _batch(case, turn.step, turn.rank, turn.micro)
        return _loss(_forward(case, model, x, turn.rank, turn.micro))

    run = train_replicas(
        ReplicaTraining(
            make_model=lambda: _build(case),
            loss=loss,
            world_size=case.world,
            steps=STEPS,
            micro_batches=_micro_batches(case),
            optimizer=sgd(LR),
        )
    )
    first = {name: g for name, g in run.grads[0].items() if g is not None}  # no rank: None
    return first, run.params


# --- shardkit (and torch's fully_shard, the control) ------------------------------------------


def _mesh(case: Case) -> DeviceMesh:
    if case.hsdp:
        return init_device_mesh("cpu", (2, case.world // 2), mesh_dim_names=("rep", "shard"))
    return init_device_mesh("cpu", (case.world,))


def _shard(case: Case, model: Any, mesh: DeviceMesh, impl: str, mark: bool) -> None:
    fully_shard = fully_shard_of(impl)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case.bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        kwargs["mp_policy"] = policy if impl == "shardkit" else torch_policy(policy)
    inner = dict(kwargs, reshard_after_forward=case.reshard)
    for module in _sharded(case, model):
        fully_shard(module, **inner)
    fully_shard(model, **kwargs)
    if mark:
        for module in _marked(case, model):
            cast(FSDPModule, module).set_conditional(True)
    if case.prefetch and case.name == "early_exit":
        blocks = model.blocks
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[1].set_modules_to_backward_prefetch([blocks[0]])


def _train(case: Case, rank: int, impl: str = "shardkit", mark: bool = True) -> dict[str, Any]:
    model: Any = _build(case)
    _shard(case, model, _mesh(case), impl, mark)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        micros = _micro_batches(case)
        for micro in range(micros):
            model.set_requires_gradient_sync(micro == micros - 1)
            _loss(_forward(case, model, _batch(case, step, rank, micro), rank, micro)).backward()
        if step == 0:
            first = _full_grads(model)
        opt.step()
        opt.zero_grad()
        if case.evaluate:
            with torch.no_grad():
                _forward(case, model, _batch(case, step, rank, 0), rank, 0)
    return {"grads": first, "params": full_params(model)}


@torch.no_grad()
def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None:
            out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).float()
    return out


def _body(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    return {"ours": _train(case, rank), "oracle": _oracle(case)}


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def _assert_matches(result: dict[str, Any], case: Case) -> None:
    first, final = result["oracle"]
    ours = result["ours"]
    # A gradient where some rank used the parameter (zeros from the others), None where none did.
    assert set(ours["grads"]) == set(first), "the parameters with a gradient"
    for name, expected in first.items():
        _close(ours["grads"][name], expected, case, name)
    for name, expected in final.items():
        _close(ours["params"][name], expected, case, name)


def _close(ours: torch.Tensor, expected: torch.Tensor, case: Case, name: str) -> None:
    """Within fp32 rounding; with bf16 compute, within 2% of the tensor's largest entry.

    bf16 keeps 8 bits of mantissa: each product, sum and the reduction itself round at 2^-9
    of its value, so an entry near zero may be off by a fraction of its tensor's scale.
    """
    if case.bf16:
        scale = float(expected.abs().max())
        rtol, atol = 2e-2, 2e-2 * scale
    else:
        rtol, atol = 1e-5, 1e-6
    torch.testing.assert_close(ours, expected, rtol=rtol, atol=atol, msg=_named(name))


def _run(case: Case) -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(case.world, _body, case=case)
    for result in results:
        _assert_matches(result, case)


CASES = [
    Case(name="tower"),  # 1: a tower that runs on rank 0 only
    Case(name="early_exit"),  # 2: blocks 2 and 3 marked, rank 1 exits after block 1
    Case(name="swap"),  # 3: B(A(x)) on rank 0, A(B(x)) on rank 1, A and B of one shape
    Case(name="experts"),  # 4: experts with no tokens on some ranks, recomputed in backward
    Case(name="moe"),  # 4, anchored by their layers: two MoE layers of three experts
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_marked_modules_train_as_the_oracle(case: Case) -> None:
    _run(case)


MATRIX = [
    Case(name="swap", reshard=True),
    Case(name="swap", reshard=False),
    Case(name="tower", reshard=False),
    Case(name="early_exit", reshard=False, prefetch=True),
    Case(name="early_exit", world=4, reshard=2),  # an int below the shard size: a 1/2 slice
    Case(name="experts", reshard=False),
    Case(name="tower", accumulate=True),
    Case(name="experts", accumulate=True),
    Case(name="early_exit", world=4, hsdp=True),
    Case(name="swap", bare_root=True),
    Case(name="swap", bare_root=True, reshard=False),
    Case(name="tower", unused=True),
    Case(name="tower", nested=True),
    Case(name="early_exit", evaluate=True),
    Case(name="swap", world=1),
    Case(name="moe", world=1),
    Case(name="moe", reshard=False),
    Case(name="moe", recompute_layers=True),
    Case(name="moe", accumulate=True),
    Case(name="moe", world=4, hsdp=True),
    Case(name="moe", bf16=True),
    Case(name="swap", bf16=True),
    Case(name="experts", bf16=True),
]


@pytest.mark.parametrize(
    "case",
    MATRIX,
    ids=lambda c: "-".join(
        [c.name, f"raf{c.reshard}", f"w{c.world}"]
        + (["hsdp"] if c.hsdp else [])
        + (["bf16"] if c.bf16 else [])
        + (["accum"] if c.accumulate else [])
        + (["bare_root"] if c.bare_root else [])
        + (["unused"] if c.unused else [])
        + (["eval"] if c.evaluate else [])
        + (["recompute_layers"] if c.recompute_layers else [])
        + (["nested"] if c.nested else [])
    ),
)
def test_marked_modules_matrix(case: Case) -> None:
    _run(case)


def _unmarked_body(rank: int, world_size: int, case: Case, checks: bool) -> dict[str, Any]:
    from shardkit.core import DesyncError, set_step_checks

    set_step_checks(checks)
    try:
        return {"ours": _train(case, rank, mark=False), "oracle": _oracle(case)}
    except DesyncError as error:
        return {"error": str(error)}
    finally:
        set_step_checks(True)


def test_unmarked_swapped_blocks_raise_where_they_would_pair_silently() -> None:
    # The same program unmarked: A's and B's gathers and reductions are of one size, so
    # rank 0's A pairs with rank 1's B. The step check (on by default) raises on every rank in
    # the first step; without it every gradient is wrong, with no error.
    from harness.pool import run_on_ranks

    for result in run_on_ranks(2, _unmarked_body, case=CASES[2], checks=True):
        assert "blocks.0" in result.get("error", "") and "blocks.1" in result["error"], result
    result = run_on_ranks(2, _unmarked_body, case=CASES[2], checks=False)[0]
    with pytest.raises(AssertionError):
        _assert_matches(result, CASES[2])


# --- the cost, against the same module unmarked where every rank runs it ------------------


def _cost_body(rank: int, world_size: int, mark: bool) -> dict[str, Any]:
    from shardkit.core import observe

    case = Case(name="tower")
    model: Any = _build(case)
    _shard(case, model, _mesh(case), "shardkit", mark)
    events: list[Any] = []
    unsubscribe = observe.subscribe(events.append)
    try:
        for step in range(2):
            events.clear()
            _loss(model(_batch(case, step, rank, 0), use_tower=True)).backward()
    finally:
        unsubscribe()
    collectives = [
        (e.kind, e.input_bytes)
        for e in events
        if isinstance(e, observe.CollectiveEvent) and e.module_fqn == "tower"
    ]
    # How long the tower's full parameters live: the events between its unshard and reshard.
    trace = [(e.module_fqn, e.what) for e in events if isinstance(e, observe.StateTransitionEvent)]
    return {"collectives": collectives, "trace": trace}


def test_a_marked_module_costs_the_same_collectives_and_bytes_in_an_spmd_program() -> None:
    from harness.pool import run_on_ranks

    marked = run_on_ranks(2, _cost_body, mark=True)[0]
    plain = run_on_ranks(2, _cost_body, mark=False)[0]
    assert sorted(marked["collectives"]) == sorted(plain["collectives"])
    assert [k for k, _ in plain["collectives"]] == ["all_gather", "all_gather", "reduce_scatter"]
    # Held longer: gathered at the root's pre-forward, before the text projection runs.
    tower_unshard = marked["trace"].index(("tower", "unshard"))
    text_forward = marked["trace"].index(("text", "pre_forward"))
    assert tower_unshard < text_forward
    plain_unshard = plain["trace"].index(("tower", "unshard"))
    assert plain_unshard > plain["trace"].index(("text", "pre_forward"))


def _moe_trace_body(rank: int, world_size: int) -> list[tuple[str, str]]:
    from shardkit.core import observe

    case = Case(name="moe")
    model: Any = _build(case)
    _shard(case, model, _mesh(case), "shardkit", mark=True)
    events: list[Any] = []
    unsubscribe = observe.subscribe(events.append)
    try:
        _loss(_forward(case, model, _batch(case, 0, rank, 0), rank, 0)).backward()
    finally:
        unsubscribe()
    return [(e.module_fqn, e.what) for e in events if isinstance(e, observe.StateTransitionEvent)]


def test_experts_are_held_and_reduced_within_their_layer() -> None:
    # Inner anchors: a layer's experts are gathered at its pre-forward and freed at its
    # post-forward (one layer's experts unsharded at a time, not the model's), and reduced
    # when the layer's backward ends: the second layer's, before the first layer's backward.
    from harness.pool import run_on_ranks

    for trace in run_on_ranks(2, _moe_trace_body):
        for expert in range(EXPERTS):
            name = f"layers.0.experts.{expert}"
            assert trace.index((name, "unshard")) > trace.index(("layers.0", "pre_forward"))
            assert trace.index((name, "reshard")) < trace.index(("layers.1", "pre_forward"))
            late = f"layers.1.experts.{expert}"
            assert trace.index((late, "post_backward")) < trace.index(("layers.0", "pre_backward"))


def _driver_body(rank: int, world_size: int, mark: bool) -> str:
    from shardkit.core.engine.state_registry import state_of

    case = Case(name="tower")
    model: Any = _build(case)
    _shard(case, model, _mesh(case), "shardkit", mark)
    model(_batch(case, 0, rank, 0), use_tower=True)
    ctx = state_of(model).ctx
    assert ctx is not None
    return type(ctx.driver).__name__


def test_a_program_with_no_marked_module_runs_the_plain_driver() -> None:
    # Nothing marked, nothing changed: not one check on any hook's path.
    from harness.pool import run_on_ranks

    assert run_on_ranks(2, _driver_body, mark=False) == ["StepDriver", "StepDriver"]
    assert run_on_ranks(2, _driver_body, mark=True) == ["ConditionalDriver"] * 2


# --- errors ------------------------------------------------------------------------------------


def _root_marked_body(rank: int, world_size: int) -> str:
    from shardkit.core import fully_shard

    model: Any = _build(Case(name="tower"))
    fully_shard(model.tower)
    fully_shard(model)
    model.set_conditional(True)  # recurse: the root too
    try:
        model(torch.randn(2, DIM), use_tower=True)
    except ValueError as error:
        return str(error)
    return ""


def test_the_root_cannot_be_conditional() -> None:
    from harness.pool import run_on_ranks

    message = run_on_ranks(2, _root_marked_body)[0]
    assert "the root FSDP module (FSDPTower) cannot be conditional" in message


def _late_mark_body(rank: int, world_size: int) -> str:
    from shardkit.core import fully_shard

    model: Any = _build(Case(name="tower"))
    fully_shard(model.tower)
    fully_shard(model)
    _loss(model(torch.randn(2, DIM), use_tower=True)).backward()
    try:
        model.tower.set_conditional(True)
    except RuntimeError as error:
        return str(error)
    return ""


def test_marking_after_the_first_forward_is_refused_by_name() -> None:
    from harness.pool import run_on_ranks

    message = run_on_ranks(2, _late_mark_body)[0]
    assert "FSDP module tower already ran a forward" in message


def _outside_anchor_body(rank: int, world_size: int) -> str:
    case = Case(name="tower")
    model: Any = _build(case)
    _shard(case, model, _mesh(case), "shardkit", mark=True)
    _loss(model(_batch(case, 0, rank, 0), use_tower=True)).backward()
    try:
        model.tower(torch.randn(2, DIM))  # outside the root's forward: nobody gathered it
    except RuntimeError as error:
        return str(error)
    return ""


def test_a_marked_module_run_outside_its_anchor_raises_rather_than_gathering_alone() -> None:
    from harness.pool import run_on_ranks

    for message in run_on_ranks(2, _outside_anchor_body):
        assert "conditional FSDP module tower: its forward ran where its anchor had not" in message


# --- torch's fully_shard, the control -------------------------------------------------------
#
# Run in processes of their own, not the pool's: torch's collectives out of step abort a rank
# inside gloo (SIGABRT) or leave it waiting, which would take the pool's workers down with it.


def _torch_control_rank(rank: int, case: Case, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=case.world,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = _build(case)
    result: dict[str, Any]
    try:
        _shard(case, model, _mesh(case), "torch", mark=False)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        first: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            _loss(_forward(case, model, _batch(case, step, rank, 0), rank, 0)).backward()
            if step == 0:
                first = _full_grads(model)
            opt.step()
            opt.zero_grad()
        result = {"grads": first, "params": full_params(model)}
    except Exception as error:  # the control's failure is its result
        result = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _torch_outcome(rank: int, exitcode: int | None, out: Path, case: Case) -> str:
    path = out / f"rank{rank}.pt"
    if not path.exists():
        return "hangs (killed)" if exitcode is None else f"dies (exit code {exitcode})"
    result = torch.load(path)
    if "error" in result:
        return f"raises {result['error']}"
    first, _ = _oracle(case)
    wrong = [
        name
        for name, expected in first.items()
        if name not in result["grads"]
        or not torch.allclose(result["grads"][name], expected, rtol=1e-5, atol=1e-6)
    ]
    return f"wrong gradients of {wrong}" if wrong else "matches the oracle"


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_torch_fully_shard_control(case: Case, tmp_path: Path) -> None:
    context = mp.get_context("spawn")
    store = tmp_path / "store"
    ranks = [
        context.Process(target=_torch_control_rank, args=(r, case, str(store), str(tmp_path)))
        for r in range(case.world)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=90)
    exitcodes: list[int | None] = []
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
            exitcodes.append(None)
        else:
            exitcodes.append(process.exitcode)
    outcomes = [_torch_outcome(r, exitcodes[r], tmp_path, case) for r in range(case.world)]
    print(f"torch fully_shard on {case.name}: {outcomes}")  # the recorded result (-s shows it)
    assert all(o != "matches the oracle" for o in outcomes), outcomes


def test_the_cases_differ_by_rank() -> None:
    # The oracle itself: the control flows do differ (a skipped rank's gradient is zero).
    case = replace(CASES[0], world=2)
    model: Any = _build(case)
    _loss(_forward(case, model, _batch(case, 0, 1, 0), 1, 0)).backward()
    assert model.tower.fc1.weight.grad is None
