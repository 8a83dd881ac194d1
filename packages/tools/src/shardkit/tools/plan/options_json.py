"""The planned options as JSON: what ``Plan.to_dict`` (and ``shardkit-plan --json``) writes.

Dtypes and enums as strings, functions by ``module:qualname``, units as their modules and
policy; callables that only feed the trace (inputs, loss, TP plan) are left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardkit.core import ReducePrecision
from shardkit.tools.plan.options import PlanOptions

__all__ = ["options_json"]


def options_json(options: PlanOptions) -> dict[str, Any]:
    """``options`` as a JSON-ready dict."""
    units = options.units
    return {
        "reshard_after_forward": options.reshard_after_forward,
        "units": None
        if units is None
        else [
            {"modules": list(u.modules), "reshard_after_forward": u.reshard_after_forward}
            for u in units
        ],
        "prefetch": options.prefetch,
        "checkpoint": [list(c) for c in options.checkpoint],
        "offload": options.offload,
        "param_dtype": _dtype_name(options.param_dtype),
        "param_dtype_override_fn": _function_name(options.param_dtype_override_fn),
        "reduce_dtype": _dtype_name(options.reduce_dtype),
        "reduce_precision": _precision(options.reduce_precision),
        "optimizer": options.optimizer,
        "bandwidth_gbps": options.bandwidth_gbps,
        "backend": options.backend,
        "rank": options.rank,
    }


def _precision(policy: ReducePrecision | None) -> dict[str, Any] | None:
    """A ``ReducePrecision`` as JSON: its fields, the wire dtype by name."""
    if policy is None:
        return None
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    wire = fields["wire_dtype"]
    fields["wire_dtype"] = _dtype_name(wire) if isinstance(wire, torch.dtype) else wire
    return fields


def _function_name(fn: Any) -> str | None:
    """``module:qualname`` of a function option, as the CLI names one (None if unset)."""
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
