"""Muon's arithmetic: Newton-Schulz on a whole matrix (alone or batched), its learning rate.

The operations and their order are those of ``torch.optim.Muon`` in torch 2.13, so that a matrix
orthogonalized here has the bits a single process's Muon gives it (the tests compare them step
for step). Two departures that change no bit: the input is never written to (torch divides its
bf16 copy in place, which is the momentum buffer itself for bf16 parameters without nesterov),
and matrices of one shape may go through batched matmuls.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "adjusted_lr",
    "batches_on",
    "check_newton_schulz",
    "newton_schulz_cost",
    "orthogonalize",
    "orthogonalize_batch",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""torch.optim.Muon's quintic coefficients (a, b, c), Keller Jordan's."""

# Devices whose batched matmuls give the per-matrix ones' bits. None so far: on the CPU, bf16
# baddbmm(G, G, G, beta=b, alpha=c) differs from addmm's in a last bit for some inputs (a
# seed in ten or so at 16 x 16; Muon at W=2 on accumulated gradients met one at its 7th step),
# and other devices pick their kernels by batch size. Matrices go one at a time until a check
# there (tests/core/optim/test_newton_schulz.py) says otherwise.
_BATCHED_DEVICES: frozenset[str] = frozenset()


def batches_on(device: torch.device) -> bool:
    """Whether :func:`orthogonalize_batch` batches its matmuls on ``device`` (else it loops)."""
    return device.type in _BATCHED_DEVICES


def check_newton_schulz(coefficients: tuple[float, ...], steps: int) -> None:
    """Refuse what torch's Muon refuses at its step, before any rank starts one.

    Raises:
        ValueError: ``steps`` of 100 or more, or not three coefficients (torch's messages).
    """
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def orthogonalize(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The Newton-Schulz orthogonalization of ``matrix`` (m, n), in bf16, as torch's Muon.

    Args:
        matrix: the whole matrix; left as it is.
        coefficients: (a, b, c) of the quintic iteration.
        steps: iterations.
        eps: the least norm divided by.

    Returns:
        (m, n) bf16, roughly U V^T of the matrix's SVD.
    """
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    if tall:
        x = x.T  # iterate on the wide side: the Gram matrix is the smaller one
    x = x.div(x.norm().clamp(min=eps))  # spectral norm at most 1
    x = _iterate(x, coefficients, steps)
    return x.T if tall else x


def orthogonalize_batch(
    matrices: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """:func:`orthogonalize` of each of ``matrices`` (B, m, n), with the bits of one at a time.

    The norms and divisions stay per matrix (a batched norm sums in another order); the
    matmuls are batched where ``_BATCHED_DEVICES`` says that keeps the bits.
    """
    if not batches_on(matrices.device):
        return torch.stack([orthogonalize(m, coefficients, steps, eps) for m in matrices])
    tall = matrices.size(1) > matrices.size(2)
    x = matrices.bfloat16()
    if tall:
        x = x.transpose(1, 2)
    x = torch.stack([m.div(m.norm().clamp(min=eps)) for m in x])  # (B, min, max)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.transpose(1, 2) if tall else x


def _iterate(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (bG + cG^2) X
    return x


def adjusted_lr(
    lr: float | torch.Tensor, adjust_lr_fn: str | None, shape: tuple[int, int]
) -> float | torch.Tensor:
    """Muon's learning rate for a matrix of ``shape``: torch's ``adjust_lr_fn`` rules.

    None or ``"original"``: lr * sqrt(max(1, m/n)) (Keller Jordan's); ``"match_rms_adamw"``:
    lr * 0.2 * sqrt(max(m, n)) (Moonshot's, the RMS of AdamW's update).
    """
    rows, cols = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def newton_schulz_cost(shape: tuple[int, int]) -> int:
    """The owners' balancing weight of a matrix: m * n * min(m, n), its FLOPs up to a factor."""
    rows, cols = shape
    return rows * cols * min(rows, cols)
