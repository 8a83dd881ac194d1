"""``shardkit-plan --export-dtype``: a weight export's predicted cost, beside the plan.

The command's ``--export-*`` options name an export of the planned model
(``shardkit.core.export``); this module turns them into an :class:`ExportSpec` on the plan's
mesh and prints :func:`export_cost`'s figures (``--json``: under ``"export"``).
"""

from __future__ import annotations

import argparse

from torch import nn
from torch.distributed.tensor import Shard

from shardkit.tools.plan.export_cost import ExportCost, ExportSpec, export_cost
from shardkit.tools.plan.export_layout import export_tensors
from shardkit.tools.plan.timing.hardware import Hardware
from shardkit.tools.plan.tp_styles import TPPlan, param_placements, resolve_plan
from shardkit.tools.units import MIB, format_bytes

__all__ = ["export_cost_of", "format_export_cost", "tp_dims_of"]


def tp_dims_of(model: nn.Module, tp_plan: TPPlan) -> dict[str, int | None]:
    """Parameter FQN -> the tensor dim ``tp_plan`` shards (None: replicated on tp)."""
    placements = param_placements(resolve_plan(model, tp_plan))
    return {k: p.dim if isinstance(p, Shard) else None for k, p in placements.items()}


def export_cost_of(
    model: nn.Module,
    args: argparse.Namespace,
    hardware: Hardware | None,
    tp_plan: TPPlan | None = None,
) -> ExportCost | None:
    """The export the command line asks for (None without ``--export-dtype``).

    Raises:
        ValueError: options the export refuses (a delta on FSDP x TP, a fraction out of range).
    """
    if args.export_dtype is None:
        return None
    tp_dims = tp_dims_of(model, tp_plan) if args.tp > 1 and tp_plan is not None else {}
    spec = ExportSpec(
        world_size=args.world_size,
        replicas=args.mesh[0] if args.mesh else 1,
        tp_degree=args.tp,
        dtype=args.export_dtype,
        bucket_bytes=max(1, int(args.export_bucket_mib * MIB)),
        to=args.export_to,
        delta_fraction=args.export_delta,
        backend=args.backend,
    )
    return export_cost(export_tensors(model, tp_dims), spec, hardware)


def format_export_cost(cost: ExportCost) -> str:
    """The export's figures, one a line."""
    rows = [
        ("model in the export dtype", format_bytes(cost.model_bytes)),
        ("buckets", f"{cost.buckets} (largest {format_bytes(cost.largest_bucket_bytes)})"),
        ("collectives (receiving rank)", str(cost.collectives)),
        ("sent by the busiest rank", format_bytes(cost.sent_bytes)),
        ("gathered into the receiving rank", format_bytes(cost.received_bytes)),
        ("on the wire, all ranks", format_bytes(cost.wire_bytes)),
        ("peak beyond training, receiving", format_bytes(cost.receiving_peak_bytes)),
        ("peak beyond training, others", format_bytes(cost.sending_peak_bytes)),
    ]
    if cost.kind == "delta":
        rows.append(("kept for the next delta", format_bytes(cost.kept_bytes)))
    time = "not estimated (--hardware)" if cost.seconds is None else f"{cost.seconds * 1e3:.3f} ms"
    rows.append(("time", time))
    lines = [f"\nWeight export ({cost.kind}):"]
    lines += [f"  {label:<34} {value}" for label, value in rows]
    return "\n".join(lines) + "\n"
