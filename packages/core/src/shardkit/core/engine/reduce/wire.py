"""Gradient rows in a narrower format for the wire, and back: pure tensor ops, no groups.

A compressed reduction (``precision.py`` beside this) sends each rank's row of a group's
gradients in one of these formats and sums the rows it receives in float32, once, on the
owner of the shard: the rounding of one cast instead of one per hop of a ring.

- **bfloat16**: each element rounded to bfloat16 (to nearest even, or stochastically). Half
  the bytes of float32.
- **int8** and **float8 (e4m3)**: elements in blocks of ``block_size``; each block is scaled by
  its largest magnitude into the format's range, and its scale travels beside it in float32.
  A row of S elements is ``ceil(S / block) * (block + 4)`` bytes: 0.254 of float32's with
  blocks of 256.

A row on the wire is a flat ``uint8`` tensor: the scales first (float32, one per block), then
the payload (one element per byte, or two for bfloat16), the last block zero-padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["WireFormat", "float8_dtype"]

_SCALE_BYTES = 4  # one float32 per block
_INT8_MAX = 127.0


def float8_dtype() -> torch.dtype | None:
    """The float8 (e4m3) dtype of the installed torch, or None where it has none."""
    return getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True, slots=True)
class WireFormat:
    """How a row of float32 gradients travels, and how it is read back."""

    dtype: torch.dtype
    """torch.bfloat16, torch.int8 or torch.float8_e4m3fn."""
    block_size: int = 256
    """Elements per scale (int8, float8); bfloat16 has no scales."""
    stochastic: bool = False
    """Round stochastically (bfloat16 and int8): unbiased, each value rounded up with the
    probability of its distance from the value below."""

    @property
    def scaled(self) -> bool:
        """Whether blocks carry a scale (int8, float8)."""
        return self.dtype != torch.bfloat16

    def blocks(self, numel: int) -> int:
        """Blocks of a row of ``numel`` elements."""
        return math.ceil(numel / self.block_size)

    def row_bytes(self, numel: int) -> int:
        """Bytes of a row of ``numel`` elements on the wire."""
        if not self.scaled:
            return 2 * numel
        return self.blocks(numel) * (self.block_size + _SCALE_BYTES)

    def encode(
        self, rows: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Write ``rows`` (R, S) float32 into ``out`` (R, row_bytes) uint8.

        Returns the values as the receiver will read them, (R, S) float32, for error feedback
        and checks. ``generator`` draws the stochastic rounding's noise (on ``rows``' device).
        """
        count, numel = rows.shape
        if not self.scaled:
            wire = out.view(torch.bfloat16)  # (R, S)
            if self.stochastic:
                wire.copy_(_stochastic_bf16(rows, generator))
            else:
                wire.copy_(rows)
            return wire.float()
        nblocks = self.blocks(numel)
        scales = out[:, : nblocks * _SCALE_BYTES].view(torch.float32)  # (R, nblocks)
        payload = out[:, nblocks * _SCALE_BYTES :]  # (R, nblocks * block)
        padded = torch.zeros(
            count, nblocks * self.block_size, dtype=torch.float32, device=rows.device
        )
        padded[:, :numel] = rows
        blocked = padded.view(count, nblocks, self.block_size)
        peak = blocked.abs().amax(dim=2)  # (R, nblocks)
        limit = _INT8_MAX if self.dtype == torch.int8 else torch.finfo(self.dtype).max
        # A zero block keeps a scale of 1: its payload is zeros either way.
        scales.copy_(torch.where(peak > 0, peak / limit, torch.ones_like(peak)))
        scaled = blocked / scales.unsqueeze(2)
        if self.dtype == torch.int8:
            if self.stochastic:
                noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
                quantized = torch.floor(scaled + noise)
            else:
                quantized = torch.round(scaled)
            values = quantized.clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
            payload.copy_(values.view(count, -1).view(torch.uint8))
        else:
            values = scaled.to(self.dtype)
            payload.copy_(values.view(count, -1).view(torch.uint8))
        decoded = values.float() * scales.unsqueeze(2)
        return decoded.view(count, -1)[:, :numel]

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 values (k, S) of rows ``wire`` (k, row_bytes) uint8, all at once."""
        count = wire.shape[0]
        if not self.scaled:
            return wire.view(torch.bfloat16).float()
        nblocks = self.blocks(numel)
        scales = wire[:, : nblocks * _SCALE_BYTES].view(torch.float32)  # (k, nblocks)
        values = wire[:, nblocks * _SCALE_BYTES :].view(self.dtype).float()
        decoded = values.view(count, nblocks, self.block_size) * scales.unsqueeze(2)
        return decoded.view(count, -1)[:, :numel]


def _stochastic_bf16(rows: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``rows`` (float32) rounded to bfloat16 stochastically.

    bfloat16 is float32's upper 16 bits: adding uniform noise to the lower 16 bits of the
    magnitude, then truncating them, rounds up with the probability of the dropped fraction.
    Infinities have zero low bits and never carry; NaNs stay NaNs.
    """
    bits = rows.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, rows.shape, dtype=torch.int32, generator=generator, device=rows.device
    )
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    return rounded.view(torch.float32).to(torch.bfloat16)
