"""What a Muon step does, counted: which matrices each rank orthogonalizes, FLOPs, bytes.

Shared by the fake-group counts (one process standing for each rank of W in turn) and the
gloo ones (W real ranks). Counting needs no numerics: the rule is Muon's with its Newton-Schulz
replaced by a stand-in that records the shape it was given and returns zeros of Muon's dtype,
so placement, owners, batching and both exchanges run as they do for Muon (the seam's
``WholeMatrixRule``; nothing is patched). On the fake group the rows received are whatever the
buffers held, which the stand-in never reads.

The models are the benchmark GPTs (``shardkit.tools.plan.gpt``: qkv, proj and the MLP's two
matrices a block; embeddings, norms, biases and the head on AdamW, as docs/guide/muon.md
groups them), built on the meta device and sharded by ``fully_shard`` per block and at the
root, then materialized (1/W of them a rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardkit.core import fully_shard
from shardkit.core.optim import MUON_RULE, StepStats, WholeMatrixOptimizer
from shardkit.core.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS
from shardkit.tools.plan.gpt import GPT, GPTConfig

MODELS = {
    # The 8M benchmark GPT's blocks (benchmarks/gpt.py "small"): 32 matrices.
    "d256x8": GPTConfig(vocab_size=4096, dim=256, n_layers=8, n_heads=4, max_seq_len=16),
    # The 35M benchmark GPT's blocks (benchmarks/gpt.py "medium"): 32 matrices.
    "d512x8": GPTConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, max_seq_len=16),
    # A realistic shape: 24 blocks of d=1024 (GPT-2 medium's), 96 matrices of 4 shapes.
    "d1024x24": GPTConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, max_seq_len=16),
}
NS_STEPS = 5
DEFAULTS: dict[str, Any] = {
    "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
    "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": 1e-7, "ns_steps": NS_STEPS,
    "adjust_lr_fn": None,
}  # fmt: skip

_SEEN: list[tuple[int, int]] = []  # the shapes this process orthogonalized since the last clear


def _stand_in(matrix: torch.Tensor, options: Any) -> torch.Tensor:
    _SEEN.append((matrix.size(0), matrix.size(1)))
    return torch.zeros(matrix.shape, dtype=torch.bfloat16, device=matrix.device)


def _stand_in_batch(matrices: torch.Tensor, options: Any) -> torch.Tensor:
    _SEEN.extend([(matrices.size(1), matrices.size(2))] * matrices.size(0))
    return torch.zeros(matrices.shape, dtype=torch.bfloat16, device=matrices.device)


COUNTING_RULE = dataclasses.replace(MUON_RULE, update=_stand_in, update_batch=_stand_in_batch)
"""Muon's placement, state and exchanges; Newton-Schulz replaced by a shape recorder."""


def newton_schulz_flops(shape: tuple[int, int], steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of torch's Muon iteration on one (m, n) matrix.

    On the wide side X (k, K), k = min(m, n): the Gram matrix X X^T (2k^2K), its square
    (2k^3) and the polynomial times X (2k^2K), each step; the norm and the adds are left out.
    """
    k, big = min(shape), max(shape)
    return steps * (4 * k * k * big + 2 * k**3)


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The blocks' 2-D matrices take Muon; embeddings, norms, biases, the head take AdamW."""
    return param.dim() == 2 and name.startswith("blocks.")


def sharded_gpt(model: str, world: int) -> nn.Module:
    """The GPT on the meta device, ``fully_shard`` per block and at the root, 1/W materialized."""
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        gpt = GPT(MODELS[model])
    for block in gpt.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(gpt, mesh=mesh)
    gpt.to_empty(device="cpu")
    with torch.no_grad():
        for p in gpt.parameters():
            p.to_local().normal_(0.0, 0.02)  # type: ignore[attr-defined]
    return gpt


def optimizers(gpt: nn.Module, optimizer: str) -> list[torch.optim.Optimizer]:
    """``optimizer``'s: 'muon' (the counting rule on the blocks' matrices, AdamW on the rest)
    or 'adamw' (AdamW on everything)."""
    if optimizer == "adamw":
        return [torch.optim.AdamW(gpt.parameters(), lr=1e-3)]
    named = list(gpt.named_parameters())
    matrices = [(n, p) for n, p in named if takes_muon(n, p)]
    others = [p for n, p in named if not takes_muon(n, p)]
    whole = WholeMatrixOptimizer(matrices, DEFAULTS, rule=COUNTING_RULE)
    return [whole, torch.optim.AdamW(others, lr=1e-3)]


@dataclass(frozen=True, slots=True)
class RankCount:
    """One rank's optimizer step."""

    shapes: list[tuple[int, int]]
    """The matrices it orthogonalized (their shapes), in order."""
    stats: StepStats
    """The optimizer's own tally of the step."""

    @property
    def flops(self) -> int:
        return sum(newton_schulz_flops(s) for s in self.shapes)


def muon_step_count(model: str, world: int) -> tuple[RankCount, list[tuple[int, int]]]:
    """This rank's Muon step, gradients set by hand (no forward); and every matrix's shape."""
    gpt = sharded_gpt(model, world)
    for p in gpt.parameters():
        p.grad = torch.zeros_like(p)
    whole = optimizers(gpt, "muon")[0]
    _SEEN.clear()
    whole.step()
    assert isinstance(whole, WholeMatrixOptimizer) and whole.last_step_stats is not None
    shapes = [(p.size(0), p.size(1)) for n, p in gpt.named_parameters() if takes_muon(n, p)]
    return RankCount(list(_SEEN), whole.last_step_stats), shapes


def training_step(gpt: nn.Module, opts: list[torch.optim.Optimizer], model: str, rank: int) -> None:
    """Forward, cross-entropy, backward, every optimizer's step, zero_grad: one sequence."""
    config = MODELS[model]
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, config.vocab_size, (1, config.max_seq_len + 1), generator=gen)
    out = gpt(idx[:, :-1])
    F.cross_entropy(out.float().reshape(-1, out.size(-1)), idx[:, 1:].reshape(-1)).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


@contextmanager
def fake_rank(world: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake group, torn down at exit.

    torch's fake group fills an all-to-all's output by repeating its input, so it refuses an
    empty input with parts to receive: what a rank that owns no matrix sends back in the
    second exchange (gloo and NCCL take it). Such a call is answered here with nothing, which
    is all the fake group would move; every other call reaches it.
    """
    real = dist.all_to_all_single

    def all_to_all_single(
        output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if input.numel() == 0:
            return None
        return real(output, input, *args, **kwargs)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = real
        dist.destroy_process_group()


def redistributing_bytes(shapes: list[tuple[int, int]], world: int) -> float:
    """Bytes a rank sends in one step of a redistributing design, averaged over the ranks.

    Each matrix's rows go to its owner in bf16 and its update's rows come back in bf16: of
    its 2mn bytes each way, the owner's own 1/W stays, so (W-1)/W of 4mn bytes cross the
    wire, shared by W ranks: 4 * N * (W-1) / W^2 a rank, N the matrices' elements.
    """
    elements = sum(m * n for m, n in shapes)
    return 4 * elements * (world - 1) / world**2
