"""Models for the FSDP1 checkpoint tests, and factories the converter imports by name.

``tiny_gpt`` is the transformer-like model: token and position embeddings, three blocks (the
FSDP1 units), a final norm and a head tied to the token embedding, plus a persistent buffer.
Its width of 6 makes most parameters' sizes odd multiples of 2 or 3, so FSDP1's 16-byte
alignment pads between them, differently for fp32 (4 elements) and bf16 (8).
"""

from __future__ import annotations

import torch
from torch import nn

from shardkit.tools.plan.gpt import GPTBlock
from tests.core.models import TinyGPT

VOCAB = 37  # that of tests.core.models' "gpt" batches, which the runs train on


def tiny_gpt(seed: int = 0) -> TinyGPT:
    """The test GPT (vocab 37, width 6, 3 blocks, tied head); its factory for the converter."""
    torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, dim=6, depth=3, seq=8, tie=True)


def wider_gpt() -> TinyGPT:
    """A model that does not match ``tiny_gpt``'s checkpoints: width 8."""
    return TinyGPT(vocab=VOCAB, dim=8, depth=3, seq=8, tie=True)


def deeper_gpt() -> TinyGPT:
    """Another mismatch: four blocks, so one unit too many."""
    return TinyGPT(vocab=VOCAB, dim=6, depth=4, seq=8, tie=True)


def block_class() -> type[nn.Module]:
    """The class FSDP1 wraps one by one."""
    return GPTBlock


class NormNet(nn.Module):
    """Linear layers around BatchNorm: mixed precision keeps BatchNorm in a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU())
        self.body = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 7))
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))  # type: ignore[no-any-return]


class Stack(nn.Module):
    """Many small layers: each unit is a small part of the whole (the memory-bound test)."""

    def __init__(self, layers: int = 24, width: int = 96) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def stack() -> Stack:
    """The factory of :class:`Stack` for the converter."""
    torch.manual_seed(0)
    return Stack()
