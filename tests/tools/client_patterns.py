"""Client patterns for comparing shardkit's collectives with torch's ``fully_shard``.

One small GPT (three blocks, each under its own ``fully_shard``, then the root), trained
in the ways client code drives a model: as is, with blocks kept gathered after forward,
with activation checkpointing, tied embeddings, a frozen block, a block called twice, a block
dropped on odd steps (LayerDrop, a branch not taken), an evaluation forward before each step,
and two micro-batches, the first without gradient sync. ``measured`` runs steps 0 to 3 and
counts what steps 2 and 3 send (the steady state: forward prefetch follows the previous step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardkit.tools import CommTracker
from shardkit.tools.plan.gpt import GPT, GPTConfig

PATTERNS = ("plain", "kept", "checkpointed", "tied", "frozen", "twice", "dropped", "eval", "accum")
_ROWS, _SEQ, _VOCAB = 2, 8, 37


class PatternGPT(GPT):
    """The GPT, its blocks run as ``pattern`` says (``step`` is the training step)."""

    pattern = "plain"
    step = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for index, block in enumerate(self.blocks):
            if self.pattern == "checkpointed":
                h = checkpoint(block, h, use_reentrant=False)
            elif self.pattern == "twice" and index == 0:
                h = block(block(h))
            elif not (self.pattern == "dropped" and index == 1 and self.step % 2 == 1):
                h = block(h)
        logits: torch.Tensor = self.head(self.ln_f(h))
        return logits


def measured(rank: int, world_size: int, engine: str, pattern: str) -> dict[str, Any]:
    """Per tracked step, the collectives (kind, input bytes) in issue order; every loss."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.core as shardkit_core

    api: Any = shardkit_core if engine == "shardkit" else torch_fsdp
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=_VOCAB,
        dim=16,
        n_layers=3,
        n_heads=2,
        max_seq_len=_SEQ,
        tie_embeddings=pattern == "tied",
    )
    model = PatternGPT(config)
    model.pattern = pattern
    if pattern == "frozen":
        model.blocks[0].requires_grad_(False)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh, reshard_after_forward=pattern != "kept")
    api.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[float] = []

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def step(number: int) -> None:
        model.step = number
        gen = torch.Generator().manual_seed(1000 * number + rank)
        x = torch.randint(0, _VOCAB, (_ROWS, _SEQ), generator=gen)
        y = torch.randint(0, _VOCAB, (_ROWS, _SEQ), generator=gen)
        opt.zero_grad()
        if pattern == "eval":
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        if pattern == "accum":
            sharded: Any = model  # an FSDPModule now, of either engine
            sharded.set_requires_gradient_sync(False)
            loss_of(x.flip(0), y.flip(0)).backward()
            sharded.set_requires_gradient_sync(True)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))

    step(0)
    step(1)
    steps = []
    for number in (2, 3):
        with CommTracker() as comm:
            step(number)
        steps.append([(c.kind, c.input_bytes) for c in comm.rank_report().collectives])
    return {"steps": steps, "losses": losses}
