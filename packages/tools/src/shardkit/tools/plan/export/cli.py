"""``shardkit-plan --export-dtype``: a weight export's predicted cost, beside the plan.

The command's ``--export-*`` options name an export of the planned model
(``shardkit.core.export``): this module adds them to the command (:func:`add_export_arguments`),
turns them into an :class:`ExportSpec` on the plan's mesh and prints :func:`export_cost`'s
figures (``--json``: under ``"export"``).
"""

from __future__ import annotations

import argparse

from torch import nn

from shardkit.tools.plan.dtype_names import dtype_argument
from shardkit.tools.plan.export.axis_gathers import export_tensors
from shardkit.tools.plan.export.cost import ExportCost, ExportSpec, export_cost
from shardkit.tools.plan.timing.hardware import Hardware
from shardkit.tools.plan.tp_styles import TPPlan, tp_dims_of
from shardkit.tools.units import MIB, format_bytes

__all__ = ["add_export_arguments", "export_cost_of", "format_export_cost"]


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--export-*`` options, as a group of their own in ``parser``'s help."""
    exporting = parser.add_argument_group(
        "a weight export's cost (shardkit.core.export)",
        "the bytes, buckets, collectives, peak and time of one export to an inference engine",
    )
    exporting.add_argument("--export-dtype", type=dtype_argument, help="the export's dtype (bf16)")
    exporting.add_argument(
        "--export-bucket-mib", type=float, default=64.0, help="a bucket's bound, MiB"
    )
    exporting.add_argument(
        "--export-to", choices=("first", "all"), default="first", help="who receives"
    )
    exporting.add_argument(
        "--export-delta", type=float, metavar="FRACTION", help="a delta export: changed elements"
    )


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
