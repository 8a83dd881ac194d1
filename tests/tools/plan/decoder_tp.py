"""The TP plan of the export tests' decoder layer (``tests/core/export/export_models.py``),
shared by the planner's export and checkpoint tests."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def decoder_tp_plan(prefix: str) -> dict[str, ParallelStyle]:
    """The TP plan of a decoder layer, its keys under ``prefix``."""
    plan: dict[str, ParallelStyle] = {
        f"{prefix}self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")
    }
    plan |= {f"{prefix}mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
    plan |= {f"{prefix}{n}": RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")}
    return plan
