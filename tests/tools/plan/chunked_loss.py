"""A chunked loss for the tools tests: the output head under its own ``fully_shard``, called
by the loss after the model's forward, once per chunk (torchtitan's and torchtune's chunked
cross-entropy). The planner is given it as ``loss(output, model)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardkit.tools import Profiler
from shardkit.tools.plan.gpt import GPT, GPTConfig

_ROWS, _SEQ, _VOCAB = 2, 8, 37  # per rank


def inputs() -> torch.Tensor:
    """One rank's token ids on the meta device, for the planner."""
    return torch.zeros(_ROWS, _SEQ, dtype=torch.long, device="meta")


CHUNKS = 2


class Trunk(GPT):
    """The tiny GPT without its head in forward: hidden states (B, T, dim) for token ids.

    The loss runs ``head`` on each chunk of them (torchtitan's and torchtune's chunked
    cross-entropy), so the head's group is called after the root's forward has returned.
    """

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        hidden: torch.Tensor = self.ln_f(h)
        return hidden


class Head(torch.nn.Linear):
    """The output head, a class of its own: ``shardkit-plan --wrap GPTBlock,Head``."""


def trunk() -> Trunk:
    config = GPTConfig(vocab_size=_VOCAB, dim=16, n_layers=2, n_heads=2, max_seq_len=_SEQ)
    model = Trunk(config)
    model.head = Head(config.dim, config.vocab_size, bias=False)
    return model


def plan_loss(hidden: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The chunked loss on the meta device, as the planner calls it: ``loss(output, model)``."""
    return cross_entropy(hidden, model, inputs())


def cross_entropy(hidden: torch.Tensor, model: Any, targets: torch.Tensor) -> torch.Tensor:
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.chunk(CHUNKS, dim=1), targets.chunk(CHUNKS, dim=1), strict=True):
        logits = model.head(h).float().flatten(0, 1)
        total = total + F.cross_entropy(logits, t.flatten(), reduction="sum")
    return total / targets.numel()


def wrap(fqn: str, module: torch.nn.Module) -> bool:
    return fqn == "head" or (fqn.startswith("blocks.") and fqn.count(".") == 1)


def measured(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.core as shardkit_core

    api: Any = shardkit_core if engine == "shardkit" else torch_fsdp
    torch.manual_seed(0)
    model = trunk()
    mesh = init_device_mesh("cpu", (world_size,))
    for fqn, module in list(model.named_modules()):
        if wrap(fqn, module):
            api.fully_shard(module, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(seed: int) -> float:
        gen = torch.Generator().manual_seed(seed)  # the same rows on every rank: fine here
        x = torch.randint(0, _VOCAB, (_ROWS, _SEQ), generator=gen)
        y = torch.randint(0, _VOCAB, (_ROWS, _SEQ), generator=gen)
        opt.zero_grad()
        loss = cross_entropy(model(x), model, y)
        loss.backward()
        opt.step()
        return float(loss.item())

    losses = [step(0)]  # steady state from here: forward prefetch follows this step's order
    with Profiler(model, optimizers=[opt]) as profiler:
        losses.append(step(1))
    losses.append(step(2))
    return {"report": profiler.rank_report().to_dict(), "losses": losses}
