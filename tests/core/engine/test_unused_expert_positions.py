"""Experts that get no tokens on some ranks, in the first, a middle or the last block, or the root.

A model as users write mixture of experts by hand: an embedding, three blocks of a projection and
a top-2 MoE layer (a router, then four expert MLPs, each its own module), a MoE layer of the
root's own, and a head. Each block is sharded as one group and the root as another, so an expert
without tokens leaves its block's reduction short of one parameter's gradient on that rank.
Where a block's reduction is issued matters: backward reaches the last block first and the first
block last, and the root's reduction closes backward. So each position is tested on its own.

Every MoE layer but the tested one sends every rank's tokens to all four experts. In the tested
one, on rank 0 in the first step every expert gets tokens and on the other ranks only experts 0
and 1 do (rank 0 reduces the block with all its gradients, the others with zeros to fill in); in
the second step, rank 0 leaves expert 3 idle too, so no rank uses it.

- Without a setting, shardkit matches the oracle (unsharded replicas, the mean of each rank's
  gradient): expert 3 keeps ``grad`` None in the second step.
- Under ``set_reduce_scatter_unused_params(True)``, shardkit is bit for bit torch's
  ``fully_shard``, which trains these with the setting (expert 3 then gets zeros). Without it,
  torch's ranks reduce gradients of different sizes (the control).

Then the middle block under the settings that change where a group's collectives go:
prefetching, ``reshard_after_forward`` False and 2 (at W=4), bf16 parameters, gradient
accumulation, HSDP (2 x 2).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import full_params, fully_shard_of, torch_policy
from tests.core.replica_oracle import Grads, ReplicaTraining, Turn, sgd, train_replicas
from tests.core.torch_releases import torch_has

DIM, EXPERTS, DEPTH, TOKENS, STEPS, LR = 8, 4, 3, 4, 2, 0.1
# Added to the router's logits of a token's two chosen experts, so top-2 picks them; their
# weights are still the softmax of the router's own logits (the router gets its gradient).
CHOICE_BIAS = 100.0
POSITIONS = {
    "first": "blocks.0.moe",
    "middle": "blocks.1.moe",
    "last": "blocks.2.moe",
    "root": "moe",
}


class MoE(nn.Module):
    """A top-2 router and one MLP module per expert; an expert with no tokens does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        # choice: (TOKENS, EXPERTS), 1 at the two experts each token goes to
        logits = self.router(x)  # (TOKENS, EXPERTS)
        picked = (logits + CHOICE_BIAS * choice.to(logits.dtype)).topk(2, dim=-1).indices
        weights = torch.softmax(logits.gather(-1, picked), dim=-1)  # (TOKENS, 2)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = (picked == index).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class Block(nn.Module):
    """A projection, then a MoE layer, with a residual: one sharded group."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(torch.tanh(self.proj(x)), choice)
        return out


class Model(nn.Module):
    """An embedding, the blocks, a MoE layer of the root's own and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.moe = MoE()  # the root's own layer: in the root's group
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, choices: list[torch.Tensor]) -> torch.Tensor:
        h = self.embed(x)
        # choices: one per MoE layer, the blocks' then the root's (the last)
        for block, choice in zip(self.blocks, choices[:DEPTH], strict=True):
            h = block(h, choice)
        out: torch.Tensor = self.head(h + self.moe(h, choices[-1]))
        return out


@dataclass(frozen=True, kw_only=True)
class Case:
    """Where the idle experts are, and the settings the model is sharded with."""

    position: str = "middle"
    world: int = 2
    hsdp: bool = False
    prefetch: bool = False  # explicit forward and backward prefetch between the blocks
    reshard: bool | int = True  # reshard_after_forward of the blocks
    bf16: bool = False  # param_dtype bf16, reduce_dtype fp32
    accumulate: bool = False  # two micro-batches a step, the first without gradient sync


def _choices(case: Case, rank: int, step: int) -> list[torch.Tensor]:
    """Each MoE layer's choice of two experts per token (the blocks', then the root's)."""
    spread = [(0, 1), (1, 2), (2, 3), (3, 0)]  # every expert gets tokens
    if rank == 0:
        idle = [(0, 1), (2, 3), (0, 2), (1, 3)] if step == 0 else [(0, 1), (1, 2), (2, 0), (0, 1)]
    else:
        idle = [(0, 1)] * TOKENS  # experts 2 and 3 get no tokens
    tested = list(POSITIONS).index(case.position)
    layers: list[torch.Tensor] = []
    for layer in range(DEPTH + 1):
        pairs = idle if layer == tested else spread
        choice = torch.zeros(TOKENS, EXPERTS)
        for token, pair in enumerate(pairs):
            choice[token, list(pair)] = 1.0
        layers.append(choice)
    return layers


def _micro_batches(case: Case) -> int:
    return 2 if case.accumulate else 1


def _loss(case: Case, model: nn.Module, rank: int, step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(TOKENS, DIM, generator=generator)
    return model(x, _choices(case, rank, step)).float().pow(2).mean()  # type: ignore[no-any-return]


def _build() -> Model:
    torch.manual_seed(5)
    return Model()


# --- the oracle: unsharded replicas -----------------------------------------------------------


def _oracle(case: Case) -> dict[str, Any]:
    """Each step's mean over ranks of each rank's gradient (None: no rank used it); the final
    parameters after SGD on them."""

    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        return _loss(case, model, turn.rank, turn.step, turn.micro)

    run = train_replicas(
        ReplicaTraining(
            make_model=_build,
            loss=loss,
            world_size=case.world,
            steps=STEPS,
            micro_batches=_micro_batches(case),
            optimizer=sgd(LR),
        )
    )
    return {"grads": run.grads, "params": run.params}


# --- shardkit, and torch's fully_shard ----------------------------------------------------------


def _mesh(case: Case) -> DeviceMesh:
    if case.hsdp:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (case.world,))


def _shard(case: Case, model: Model, impl: str, unused_zeros: bool) -> Any:
    fully_shard = fully_shard_of(impl)
    kwargs: dict[str, Any] = {"mesh": _mesh(case)}
    if case.bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs["mp_policy"] = policy if impl == "shardkit" else torch_policy(policy)
    blocks: list[Any] = [
        fully_shard(b, reshard_after_forward=case.reshard, **kwargs) for b in model.blocks
    ]
    root = fully_shard(model, **kwargs)
    if case.prefetch:
        for before, after in itertools.pairwise(blocks):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    if unused_zeros:
        root.set_reduce_scatter_unused_params(True)  # recursive in both engines: every group
    return root


@torch.no_grad()
def _full_grads(model: nn.Module) -> Grads:
    out: Grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        out[name] = None if full is None else full.detach().clone()
    return out


def _train(case: Case, rank: int, impl: str, unused_zeros: bool) -> dict[str, Any]:
    model = _build()
    sharded = _shard(case, model, impl, unused_zeros)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    grads: list[Grads] = []
    micros = _micro_batches(case)
    for step in range(STEPS):
        for micro in range(micros):
            sharded.set_requires_gradient_sync(micro == micros - 1)
            loss = _loss(case, model, rank, step, micro)
            loss.backward()
            losses.append(loss.item())
        grads.append(_full_grads(model))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": full_params(model)}


# torch's engine, the bitwise peer under the switch, has it from 2.13 on; before, shardkit's
# switch is checked against the single-process oracle alone.
_TORCH_HAS_SWITCH = torch_has("FSDPModule.set_reduce_scatter_unused_params")


def _body(rank: int, world_size: int, case: Case, unused_zeros: bool) -> dict[str, Any]:
    impls = ("shardkit", "torch") if unused_zeros and _TORCH_HAS_SWITCH else ("shardkit",)
    out = {impl: _train(case, rank, impl, unused_zeros) for impl in impls}
    out["oracle"] = _oracle(case)
    return out


def _assert_matches_oracle(
    ours: dict[str, Any], oracle: dict[str, Any], case: Case, unused_zeros: bool
) -> None:
    tolerance = _tolerance(case)
    for step, expected_grads in enumerate(oracle["grads"]):
        for name, expected in expected_grads.items():
            got = ours["grads"][step][name]
            where = f"step {step}, {name}"
            if expected is None and not unused_zeros:
                assert got is None, f"{where}: no rank used it, yet it has a gradient"
                continue
            assert got is not None, f"{where}: no gradient"
            want = torch.zeros_like(got) if expected is None else expected
            torch.testing.assert_close(got, want, **tolerance(want), msg=_named(where))
    for name, expected in oracle["params"].items():
        got = ours["params"][name]
        torch.testing.assert_close(got, expected, **tolerance(expected), msg=_named(name))


def _tolerance(case: Case) -> Any:
    """fp32: rounding. bf16 compute: 2% of the tensor's largest entry (8 bits of mantissa)."""

    def of(expected: torch.Tensor) -> dict[str, float]:
        if not case.bf16:
            return {"rtol": 1e-5, "atol": 1e-6}
        return {"rtol": 2e-2, "atol": 2e-2 * float(expected.abs().max())}

    return of


def _named(where: str) -> Any:
    return lambda message: f"{where}: {message}"


def _assert_bitwise(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["losses"] == theirs["losses"]
    for step, (mine, torchs) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
        for name, value in torchs.items():
            got = mine[name]
            assert (got is None) == (value is None), f"step {step}, {name}"
            assert got is None or torch.equal(got, value), f"step {step}, {name}"
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def _check(case: Case, unused_zeros: bool) -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(case.world, _body, case=case, unused_zeros=unused_zeros)
    for result in results:
        _assert_matches_oracle(result["shardkit"], result["oracle"], case, unused_zeros)
        if unused_zeros and _TORCH_HAS_SWITCH:
            _assert_bitwise(result["shardkit"], result["torch"])
    # The premise: expert 3 of the tested layer is idle on every rank in the second step only.
    idle = f"{POSITIONS[case.position]}.experts.3.0.weight"
    oracle = results[0]["oracle"]["grads"]
    assert oracle[0][idle] is not None and oracle[1][idle] is None, idle
    if not unused_zeros:
        assert results[0]["shardkit"]["grads"][1][idle] is None


@pytest.mark.parametrize("unused_zeros", [False, True], ids=["default", "unused_zeros"])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_idle_experts_at_each_position(position: str, unused_zeros: bool) -> None:
    _check(Case(position=position), unused_zeros)


VARIANTS = [
    Case(prefetch=True),
    Case(reshard=False),
    Case(world=4, reshard=2),  # a 1/2 slice held between forward and backward
    Case(bf16=True),
    Case(accumulate=True),
    Case(world=4, hsdp=True),
]


def _variant_id(case: Case) -> str:
    parts = [f"w{case.world}"]
    parts += ["prefetch"] if case.prefetch else []
    parts += [f"raf{case.reshard}"] if case.reshard is not True else []
    parts += ["bf16"] if case.bf16 else []
    parts += ["accumulate"] if case.accumulate else []
    parts += ["hsdp"] if case.hsdp else []
    return "-".join(parts)


@pytest.mark.parametrize("unused_zeros", [False, True], ids=["default", "unused_zeros"])
@pytest.mark.parametrize("case", VARIANTS, ids=_variant_id)
def test_idle_experts_in_the_middle_block_under_each_setting(
    case: Case, unused_zeros: bool
) -> None:
    _check(case, unused_zeros)


def torch_control(rank: int, world_size: int) -> str:
    """The middle block's case under torch's ``fully_shard``, no setting
    (``tests.core.torch_control`` runs it)."""
    case = Case()
    model = _build()
    _shard(case, model, "torch", unused_zeros=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(case, model, rank, step, 0).backward()
        opt.step()
        opt.zero_grad()
    return "trained"


def test_torch_control_fails_without_the_setting() -> None:
    from tests.core.torch_control import run_control

    outcome = run_control(f"{__name__}:torch_control")
    print(f"torch fully_shard, idle experts in the middle block: {outcome}")  # -s shows it
    # torch reduces the gradients each rank has: rank 0's middle block has more.
    assert not outcome.trained, outcome


def test_the_choices_leave_the_tested_layer_idle_as_described() -> None:
    # The oracle itself: on rank 1 experts 2 and 3 of the tested layer have no gradient.
    model = _build()
    _loss(Case(position="last"), model, 1, 0, 0).backward()
    params = dict(model.named_parameters())
    assert params["blocks.2.moe.experts.3.0.weight"].grad is None
    assert params["blocks.2.moe.experts.1.0.weight"].grad is not None
    assert params["blocks.1.moe.experts.3.0.weight"].grad is not None
