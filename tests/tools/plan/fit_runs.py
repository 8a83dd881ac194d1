"""Training the demo GPT under a sharding plan the search chose, two ways, at W ranks.

``shardkit``: ``apply_plan`` with shardkit's engine, the step's peak of live tensor bytes
measured (``LivePeak``) on the last step. ``torch-code``: the ``parallelize`` function
``parallelize_source`` writes for torch's ``fully_shard``, executed as a user pastes it. Both
train 3 AdamW steps on the same seeded data; the losses are compared bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardkit.tools.plan.apply.apply import apply_plan
from shardkit.tools.plan.apply.parallelize_source import parallelize_source
from shardkit.tools.plan.apply.plan_json import load_plan
from shardkit.tools.plan.examples import gpt_demo_inputs
from shardkit.tools.plan.gpt import GPT, GPTConfig
from shardkit.tools.track.live_peak import LivePeak

STEPS = 3
CONFIG = GPTConfig(vocab_size=256, dim=128, n_layers=6, n_heads=4, max_seq_len=128)


def next_token_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position against token 0, targets made where the output is
    (meta for the planner, the CPU here)."""
    rows = out.shape[0] * out.shape[1]
    return F.cross_entropy(
        out.float().reshape(rows, -1), torch.zeros(rows, dtype=torch.long, device=out.device)
    )


def _apply(how: str, model: nn.Module, plan_json: str, world_size: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    plan = load_plan(plan_json)
    if how == "shardkit":
        return apply_plan(model, plan, mesh=mesh)
    namespace: dict[str, Any] = {}
    exec(parallelize_source(plan, engine="torch", model=model), namespace)
    result: nn.Module = namespace["parallelize"](model, mesh)
    return result


def train_body(rank: int, world_size: int, plan_json: str, how: str) -> dict[str, Any]:
    """Losses of each step and, for shardkit, the last step's peak of live tensor bytes."""
    torch.manual_seed(0)
    model = _apply(how, GPT(CONFIG), plan_json, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = gpt_demo_inputs().shape
    generator = torch.Generator().manual_seed(1000 + rank)
    losses: list[float] = []
    peak = 0
    for step in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, shape, generator=generator)
        live = LivePeak(model, optimizers=[optimizer])
        with live if how == "shardkit" and step == STEPS - 1 else contextlib.nullcontext():
            loss = next_token_loss(model(tokens))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = max(peak, live.peak)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {"losses": losses, "peak": peak}
