"""How far each reduction mode lands from the exact sum, as the world size grows.

Real gradients: the demo GPT (``demo/model.py``) on W different batches of the shipped corpus,
one per simulated rank, all in one process. Each mode reduces the same W float32 gradients with
real arithmetic, as the collective would, and is compared with their sum in float64:

- ``fp32 ring``: a ring reduce-scatter in float32 (NCCL's fp32 path): each hop adds a rank's
  float32 value to the running float32 sum.
- ``bf16 ring``: torch's ``reduce_dtype=torch.bfloat16``: the gradients cast to bfloat16, and
  each of the W-1 hops adds in float32 and rounds the running sum to bfloat16 to send it on.
- ``bf16 wire, fp32 sum`` (and its stochastic rounding), ``int8 wire``, ``fp8 wire``: each
  rank's row encoded once (``engine/reduce/wire.py``, the engine's own code), the owner adding
  the W rows in float32, its own exact.

Errors are normwise over the whole model's gradient: RMS (``||x - ref|| / ||ref||``) and max
(``max |x - ref| / max |ref|``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from demo.batches import BatchSampler, load_corpus
from demo.model import GPT, ModelConfig

from shardkit.core.engine.reduce.wire import WireFormat

ROOT = Path(__file__).resolve().parents[1]
WORLDS = (2, 4, 8, 16, 32, 64)


def demo_gradients(world: int, *, seed: int = 0, small: bool = False) -> torch.Tensor:
    """(W, N) float32: the demo GPT's flat gradient on each of ``world`` ranks' batches.

    ``small``: a 2-layer, 64-wide model on 32-byte sequences (a test's budget).
    """
    torch.manual_seed(seed)
    config = ModelConfig(d_model=64, n_layers=2, seq_len=32) if small else ModelConfig()
    model = GPT(config)
    data = load_corpus(ROOT / "demo" / "data" / "corpus.txt")
    rows = []
    for rank in range(world):
        sampler = BatchSampler(
            data=data, seq_len=config.seq_len, batch_per_rank=4, rank=rank, world=world, seed=seed
        )
        inputs, targets = sampler.batch(0)
        model.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    return torch.stack(rows)  # (W, N)


def _ring(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ring's sum: each hop adds the next rank's value in float32, then rounds to ``dtype``."""
    running = grads[0].to(dtype)
    for rank in range(1, grads.shape[0]):
        running = (running.float() + grads[rank].to(dtype).float()).to(dtype)
    return running.float()


def _wire(fmt: WireFormat) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(grads: torch.Tensor) -> torch.Tensor:
        # The owner's own row never travels: rank 0 here (any rank is alike).
        out = torch.empty(grads.shape[0], fmt.row_bytes(grads.shape[1]), dtype=torch.uint8)
        generator = torch.Generator().manual_seed(0)
        decoded = fmt.encode(grads, out, generator)
        decoded[0] = grads[0]
        total = torch.zeros(grads.shape[1], dtype=torch.float32)
        for row in decoded:
            total.add_(row)
        return total

    return reduce


MODES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp32 ring": lambda g: _ring(g, torch.float32),
    "bf16 ring": lambda g: _ring(g, torch.bfloat16),
    "bf16 wire, fp32 sum": _wire(WireFormat(torch.bfloat16)),
    "bf16 wire (stochastic), fp32 sum": _wire(WireFormat(torch.bfloat16, stochastic=True)),
    "int8 wire (256), fp32 sum": _wire(WireFormat(torch.int8, 256)),
    "fp8 e4m3 wire (256), fp32 sum": _wire(WireFormat(torch.float8_e4m3fn, 256)),
}


@dataclass(frozen=True, slots=True)
class ModeError:
    """One mode's error at one world size."""

    mode: str
    world: int
    rms: float
    """||x - ref|| / ||ref||."""
    max: float
    """max |x - ref| / max |ref|."""


def errors(
    grads: torch.Tensor, modes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = MODES
) -> list[ModeError]:
    """Each mode's error on ``grads`` (W, N) against their float64 sum."""
    reference = grads.double().sum(dim=0)
    found = []
    for name, reduce in modes.items():
        diff = reduce(grads).double() - reference
        rms = float(diff.norm() / reference.norm())
        peak = float(diff.abs().max() / reference.abs().max())
        found.append(ModeError(name, grads.shape[0], rms, peak))
    return found


def study(worlds: tuple[int, ...] = WORLDS, *, small: bool = False) -> list[ModeError]:
    """Every mode at every world size, on the demo GPT's gradients."""
    grads = demo_gradients(max(worlds), small=small)
    return [e for world in worlds for e in errors(grads[:world])]
