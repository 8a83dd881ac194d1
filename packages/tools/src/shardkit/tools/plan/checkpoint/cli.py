"""``shardkit-plan --checkpoint``: a checkpoint save's predicted cost, beside the plan.

With the save's: the layout record's size and a rank's load planning from it (``load_cost``).

The state saved is ``{"model": ..., "optim": ...}`` of ``get_state_dict(model, optimizer)``
with the command's ``--optimizer``, on the plan's mesh (``--mesh``, ``--tp``); this module
adds ``--checkpoint`` and ``--disk-gib-s`` to the command (:func:`add_checkpoint_arguments`),
builds the save's layout (``layout``), times the core's planning once here (``timing``) and
prints :func:`checkpoint_cost`'s figures (``--json``: under ``"checkpoint"``).
"""

from __future__ import annotations

import argparse
import functools
import textwrap

from torch import nn

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout
from shardkit.tools.plan.checkpoint.cost import DEFAULT_DISK_GIB_S, CheckpointCost, checkpoint_cost
from shardkit.tools.plan.checkpoint.load_cost import LoadCosts, calibrate_load_planning
from shardkit.tools.plan.checkpoint.meta_state import (
    CheckpointMesh,
    checkpoint_state,
    dcp_fallback_reason,
)
from shardkit.tools.plan.checkpoint.timing import SaveCosts, calibrate_save_planning
from shardkit.tools.plan.tp_styles import TPPlan, tp_dims_of
from shardkit.tools.units import format_bytes

__all__ = ["add_checkpoint_arguments", "checkpoint_cost_of", "format_checkpoint_cost", "mesh_of"]


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint`` and ``--disk-gib-s``, as a group of their own in ``parser``'s help."""
    saving = parser.add_argument_group(
        "a checkpoint save's cost (shardkit.core's CheckpointManager)",
        "bytes per rank, .metadata, planning and write time of saving the model and --optimizer",
    )
    saving.add_argument("--checkpoint", action="store_true", help="predict a save")
    saving.add_argument(
        "--disk-gib-s",
        type=float,
        default=DEFAULT_DISK_GIB_S,
        help=f"write bandwidth per rank, GiB/s (default {DEFAULT_DISK_GIB_S:g})",
    )


def mesh_of(args: argparse.Namespace) -> CheckpointMesh:
    """The command line's mesh: (replicas, shard, tp).

    Raises:
        ValueError: a world size the mesh does not divide into.
    """
    tp = args.tp
    replicas, shard = args.mesh if args.mesh else (1, args.world_size // max(tp, 1))
    mesh = CheckpointMesh(replicas, shard, tp)
    if mesh.world_size != args.world_size:
        raise ValueError(
            f"--world-size {args.world_size} is not the mesh's {replicas} x {shard} x tp {tp}"
        )
    return mesh


def checkpoint_cost_of(
    model: nn.Module, args: argparse.Namespace, tp_plan: TPPlan | None = None
) -> CheckpointCost | None:
    """The save the command line asks for (None without ``--checkpoint``).

    Raises:
        ValueError: a mesh, optimizer or bandwidth the prediction refuses.
    """
    if not args.checkpoint:
        return None
    mesh = mesh_of(args)
    tp_dims = tp_dims_of(model, tp_plan) if args.tp > 1 and tp_plan is not None else {}
    values, mappings, plain_sizes = checkpoint_state(model, mesh, args.optimizer, tp_dims)
    layout = SaveLayout.from_values(values, mesh.world_size)
    costs, load_costs = _calibrated()
    fallback = dcp_fallback_reason(model, mesh, tp_dims)
    return checkpoint_cost(
        layout, plain_sizes, costs, args.disk_gib_s, mappings, fallback, load_costs
    )


@functools.cache
def _calibrated() -> tuple[SaveCosts, LoadCosts]:
    """The per-unit costs of a save's and a load's planning, measured once a process."""
    return calibrate_save_planning(), calibrate_load_planning()


def format_checkpoint_cost(cost: CheckpointCost) -> str:
    """The save's figures, one a line."""

    def spread(per_rank: list[int]) -> str:
        s = cost.spread(per_rank)
        return f"{format_bytes(s['min'])} / {format_bytes(s['median'])} / {format_bytes(s['max'])}"

    items = cost.spread(cost.items)
    rows = [
        ("values (flat state dict)", f"{cost.values} ({cost.geometries} geometries)"),
        ("data per rank, min/median/max", spread(cost.data_bytes)),
        ("file per rank, min/median/max", spread(cost.file_bytes)),
        (
            "items per rank, min/median/max",
            f"{items['min']} / {items['median']:g} / {items['max']}",
        ),
        ("busiest rank", str(cost.busiest_rank)),
        (".metadata entries", f"{cost.entries:,}"),
        (
            ".metadata size",
            ("" if cost.metadata_exact else "~") + format_bytes(cost.metadata_bytes),
        ),
        ("planning per rank, each save", f"{cost.plan_s * 1e3:.3f} ms"),
        ("planning per rank, first save", f"{cost.first_plan_s * 1e3:.3f} ms"),
        ("rank 0's metadata, first save", f"{cost.rank0_metadata_s * 1e3:.3f} ms"),
        (f"write at {cost.disk_gib_s:g} GiB/s a rank", f"{cost.write_s * 1e3:.3f} ms"),
        ("planning collectives", "0 (each rank plans alone)"),
        ("layout record (layout.json)", format_bytes(cost.record_bytes)),
    ]
    if cost.load_plan_s is not None:
        rows.append(("load planning per rank", f"{cost.load_plan_s * 1e3:.3f} ms (same layout)"))
    lines = [f"\nCheckpoint save (W={cost.world_size}):"]
    if cost.dcp_fallback:
        warning = (
            f"falls back to DCP's planning: {cost.dcp_fallback}. The figures below are the "
            "local plan's: DCP's split of the chunks and rank 0's global plan are not predicted"
        )
        lines += textwrap.wrap(warning, width=96, initial_indent="  ", subsequent_indent="    ")
    lines += [f"  {label:<34} {value}" for label, value in rows]
    texts = [f"assumes {cost.assumption}", f"time per unit: {cost.costs.source}"]
    if cost.load_costs is not None:
        texts.append(f"load time per unit: {cost.load_costs.source}")
    for text in texts:
        lines += textwrap.wrap(text, width=96, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"
