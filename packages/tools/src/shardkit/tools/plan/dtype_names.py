"""dtype names as ``shardkit-plan`` takes them: ``bf16``, ``fp32``, ``float16``, ...

The command's dtype options and ``--fit``'s ``--precision`` lists read the same names, so a
name that works in one works in the other.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["DTYPE_NAMES", "dtype_argument", "short_name"]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def dtype_argument(name: str) -> torch.dtype:
    """The dtype ``name`` stands for (any case), for argparse's ``type=``.

    Raises:
        argparse.ArgumentTypeError: an unknown name, the known ones listed.
    """
    try:
        return DTYPE_NAMES[name.lower()]
    except KeyError:
        known = ", ".join(DTYPE_NAMES)
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r} (one of {known})") from None


def short_name(dtype: torch.dtype) -> str:
    """The first (shortest) name of ``dtype``: ``bf16``, ``fp32``."""
    return next(name for name, known in DTYPE_NAMES.items() if known is dtype)
