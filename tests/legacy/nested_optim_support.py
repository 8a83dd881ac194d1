"""The nested model of FSDP1's optimizer-state scenarios, its wrapping, optimizer and training.

Shared by ``test_optim_scenarios.py`` and ``test_fsdp1_optim_scenarios.py``: a model wrapped by
hand (the root is no unit, units inside units, a root-level parameter no unit holds), Adam over
one or two parameter groups, and a few steps on data every rank shares.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from tests.legacy.legacy_parity import lib

__all__ = ["STEPS", "Nested", "cloned", "optim_input", "root_model", "setup", "train", "wrapped"]

STEPS = 3


class Shift(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim_in, dim_out) / dim_in**0.5)
        self.shift0 = Shift(dim_out)
        self.shift1 = Shift(dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.shift1(torch.relu(self.shift0(x @ self.weight)))
        return out


class Nested(nn.Module):
    """Units inside units under a root that is no unit; ``scale`` belongs to no unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block0 = Block(5, 3)
        self.block1 = Block(3, 7)
        self.scale = nn.Parameter(torch.randn(5))
        self.stack = nn.Sequential(Block(7, 9), Block(9, 9), Block(9, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.block1(torch.relu(self.block0(x))))
        out: torch.Tensor = self.stack(x) * self.scale
        return out


def wrapped(impl: str, model: Any = None, **kwargs: Any) -> Any:
    """FSDP1's manual nested wrapping: inner units first; block0 and the root stay plain."""
    fsdp = lib(impl).FSDP
    model = model if model is not None else Nested()
    kwargs = {"device_id": torch.device("cpu"), **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.block1.shift0 = fsdp(model.block1.shift0, **kwargs)
        model.block1 = fsdp(model.block1, **kwargs)
        model.stack[1].shift0 = fsdp(model.stack[1].shift0, **kwargs)
        model.stack[1].shift1 = fsdp(model.stack[1].shift1, **kwargs)
        model.stack[1] = fsdp(model.stack[1], **kwargs)
        model.stack[2] = fsdp(model.stack[2], **kwargs)
    return model


def optim_input(model: Any, two_groups: bool, reverse: bool) -> list[Any]:
    """All parameters in one group; or block1's, then the stack's and block0's (no scale)."""
    if not two_groups:
        params = list(model.parameters())
        return params[::-1] if reverse else params
    first = list(model.block1.parameters())
    second = list(model.stack.parameters()) + list(model.block0.parameters())
    if reverse:
        first, second = first[::-1], second[::-1]
    return [{"params": first}, {"params": second, "weight_decay": 0.5}]


def setup(
    impl: str, two_groups: bool = True, reverse: bool = False, **kwargs: Any
) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    model = wrapped(impl, **kwargs)
    groups = optim_input(model, two_groups, reverse)
    return model, torch.optim.Adam(groups, lr=0.01), groups


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS) -> list[float]:
    """Every rank the same data (the losses are each rank's own, equal across ranks)."""
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 5, generator=generator)).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def cloned(value: Any) -> Any:
    """Plain tensors cloned, in nested dicts and lists."""
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cloned(v) for v in value]
    if type(value) is torch.Tensor:
        return value.clone()
    return value


def root_model(impl: str, **kwargs: Any) -> nn.Module:
    """The model under one root unit (FSDP1's tests of these wrap it so)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib(impl).FSDP(Nested(), device_id=torch.device("cpu"), **kwargs)  # type: ignore[no-any-return]
