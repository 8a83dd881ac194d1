"""Client patterns for comparing shardkit's collectives with torch's ``fully_shard``.

One small GPT (three blocks, each under its own ``fully_shard``, then the root), trained
in the ways client code drives a model: as is, with blocks kept gathered after forward or
resharded to 2 of 4 ranks, with activation checkpointing, tied embeddings, a frozen block, a
block called twice, a block dropped on odd steps (LayerDrop, a branch not taken), an
evaluation forward or three no-grad forwards (generation) before each step, two micro-batches
(the first without gradient sync), bf16 mixed precision, each block's MLP sharded on its own
too, torchtitan's explicit prefetch, the user's ``unshard()`` before forward, and HSDP (2 x 2).
``measured`` runs steps 0 to 3 and profiles steps 2 and 3 (the steady state: forward prefetch
follows the previous step): what they send, and their memory peak.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardkit.tools import Profiler
from shardkit.tools.plan.gpt import GPT, GPTConfig

PATTERNS: tuple[str, ...] = ("plain", "kept", "checkpointed", "tied", "frozen", "twice")
PATTERNS += ("dropped", "eval", "generate", "accum", "bf16", "nested", "explicit", "unshard")
PATTERNS += ("sliced", "hsdp")
WORLD_SIZE = {"sliced": 4, "hsdp": 4}  # 2 otherwise
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
    """Per tracked step, the collectives (kind, input bytes) in issue order and the peak of
    the memory the tracker attributes (parameters, gradients, optimizer state, activations,
    buffers); every loss."""
    import torch.distributed.fsdp as torch_fsdp

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
    _shard(api, model, pattern, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[float] = []

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())

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
        if pattern == "generate":
            with torch.no_grad():
                for _ in range(3):
                    model(x)
        if pattern == "unshard":
            sharded_root: Any = model
            sharded_root.unshard()
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
    steps, peaks = [], []
    for number in (2, 3):
        with Profiler(model, optimizers=[opt]) as profiler:
            step(number)
        report = profiler.rank_report()
        steps.append([(c.kind, c.input_bytes) for c in report.collectives])
        assert report.memory is not None
        peaks.append(report.memory.peak.total)
    return {"steps": steps, "peaks": peaks, "losses": losses}


def _shard(api: Any, model: PatternGPT, pattern: str, world_size: int) -> None:
    """``fully_shard`` on each block (and its MLP where nested), then the root."""
    from torch.distributed.device_mesh import init_device_mesh

    if pattern == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    options: dict[str, Any] = {"mesh": mesh}
    if pattern == "bf16":
        options["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    after_forward = {"kept": False, "sliced": 2}.get(pattern, True)
    for block in model.blocks:
        if pattern == "nested":
            api.fully_shard(block.mlp, **options)
        api.fully_shard(block, reshard_after_forward=after_forward, **options)
    api.fully_shard(model, **options)
    if pattern == "explicit":  # torchtitan's: each block names the next, both ways
        blocks: list[Any] = list(model.blocks)
        for earlier, later in itertools.pairwise(blocks):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
