"""Parameters a backward does not reach train as in torch's FSDP1, bit for bit.

FSDP1 reduces a unit's whole flat gradient, zeros where a parameter took no part: with
``use_orig_params=True`` those parameters get zero gradients, not None, so AdamW's weight
decay and momentum still move them, and ranks may reach different parameters of a unit
(control flow that depends on the data). shardkit.legacy reduces unused parameters as zeros
(the core's ``set_reduce_scatter_unused_params``) for the same values.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import lib

STEPS = 4


class _Branches(nn.Module):
    """``branch`` runs at even steps (shifted by ``shift``); ``spare`` never runs."""

    def __init__(self, shift: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)
        self.spare = nn.Linear(6, 6)
        self.shift = shift

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if (step + self.shift) % 2 == 0:
            h = torch.relu(self.branch(h))
        out: torch.Tensor = self.head(h)
        return out


def _train(impl: str, rank: int, strategy: str, orig: bool, wrap: str) -> dict[str, Any]:
    ns = lib(impl)
    # "ranks_differ": each rank runs the branch at other steps (one unit holds it all).
    model = _Branches(shift=rank if wrap == "ranks_differ" else 0)
    kwargs = {
        "device_id": torch.device("cpu"),
        "sharding_strategy": getattr(ns.ShardingStrategy, strategy),
        "use_orig_params": orig,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if wrap == "branch_unit":  # the branch a unit of its own, skipped at odd steps
            model.branch = ns.FSDP(model.branch, **kwargs)
        wrapped = ns.FSDP(model, **kwargs)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05, weight_decay=0.1)
    data = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS):
        loss = wrapped(torch.randn(4, 6, generator=data), step).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with ns.FSDP.summon_full_params(wrapped):
        params = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    return {"losses": losses, "params": params}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for orig in (False, True):
            for wrap in ("one_unit", "branch_unit", "ranks_differ"):
                for impl in ("shardkit", "torch"):
                    out[f"{impl}/{strategy}/{orig}/{wrap}"] = _train(
                        impl, rank, strategy, orig, wrap
                    )
    return out


def test_unused_parameters_train_as_fsdp1s_bit_for_bit() -> None:
    for rank, out in enumerate(run_on_ranks(2, _body)):
        cases = [key.removeprefix("torch/") for key in out if key.startswith("torch/")]
        assert len(cases) == 12
        for case in cases:
            ours, theirs = out[f"shardkit/{case}"], out[f"torch/{case}"]
            where = f"rank {rank} {case}"
            assert ours["losses"] == theirs["losses"], where
            assert ours["params"].keys() == theirs["params"].keys(), where
            for name, value in ours["params"].items():
                assert torch.equal(value, theirs["params"][name]), f"{where} {name}"
            # The spare layer never ran, yet weight decay moved it (its gradient is zeros).
            torch.manual_seed(0)
            assert not torch.equal(ours["params"]["spare.weight"], _Branches(0).spare.weight)
