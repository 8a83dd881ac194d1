"""The tables ``shardkit-plan`` prints: groups, sharding units, collectives, memory."""

from __future__ import annotations

from typing import Any

import torch

from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.records import Bandwidth, CollectivePlan, PlannedGroup
from shardkit.tools.records import Category
from shardkit.tools.units import format_bytes

__all__ = ["format_plan"]


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_plan(
    result: Plan,
    *,
    title: str = "model",
    all_groups: bool = False,
    bandwidth: Bandwidth | None = None,
) -> str:
    """The plan as readable tables (what ``shardkit-plan`` prints).

    ``bandwidth`` says where the plan's bandwidth came from; None: given in its options.
    """
    o = result.options
    mesh = f"HSDP {result.replicas}x{result.shard_size}" if result.replicas > 1 else "FSDP"
    if result.tp_degree > 1:
        mesh += f" x TP {result.tp_degree}"
    dtypes = f"param_dtype {_name(o.param_dtype)}, reduce_dtype {_name(o.reduce_dtype)}"
    lines = [
        f"{title} on {result.world_size} ranks ({mesh}); {dtypes}; {o.optimizer}; {o.backend}",
        f"parameters: {_count(result.param_count)} ({_count(result.trainable_count)} trainable)"
        f" in {len(result.groups)} groups",
        *_units(result),
        "",
        *_group_table(result.groups, all_groups),
        "",
        *_comm_table(result.collectives, all_groups),
        "",
        *_comm_totals(result, bandwidth),
        "",
        *_memory_table(result),
    ]
    return "\n".join(lines) + "\n"


def _units(result: Plan) -> list[str]:
    """Which modules got a ``fully_shard`` call, and what chose them."""
    wrap = result.options.wrap
    if wrap is None:
        rule = "by default every element of an nn.ModuleList (--wrap CLASSES to choose)"
    elif callable(wrap):
        rule = "by the wrap policy given"
    else:
        rule = "by --wrap " + ",".join(sorted(wrap))
    by_class: dict[str, list[str]] = {}
    for g in result.groups:
        by_class.setdefault(g.module_class, []).append(g.fqn)
    lines = [f"sharding units (one fully_shard each), {rule}:"]
    for cls, fqns in by_class.items():
        where = fqns[0] if len(fqns) == 1 else f"{fqns[0]} .. {fqns[-1]}"
        lines.append(f"  {cls}" + (f" x{len(fqns)}" if len(fqns) > 1 else "") + f": {where}")
    return lines


def _name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _runs(names: list[str], keys: list[Any], collapse: bool) -> list[tuple[str, int, int]]:
    """(label, first index, count) for runs of consecutive equal keys."""
    runs: list[tuple[str, int, int]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or not collapse or keys[i] != keys[start]:
            count = i - start
            label = names[start] if count == 1 else f"{names[start]} .. {names[i - 1]}"
            runs.append((label, start, count))
            start = i
    return runs


def _group_table(groups: tuple[PlannedGroup, ...], all_groups: bool) -> list[str]:
    header = f"{'group (per rank)':<28} {'params':>9} {'sharded':>11} {'unsharded':>11} "
    header += f"{'gather in':>11} {'reduce out':>11}  reshard"
    lines = [header]
    keys = [(g.param_count, g.sharded_bytes, g.reshard_after_forward) for g in groups]
    for label, i, count in _runs([g.fqn for g in groups], keys, not all_groups):
        g = groups[i]
        times = f" (x{count})" if count > 1 else ""
        lines.append(
            f"{label + times:<28} {_count(g.param_count):>9} {format_bytes(g.sharded_bytes):>11} "
            f"{format_bytes(g.unsharded_bytes):>11} {format_bytes(g.gather_input_bytes):>11} "
            f"{format_bytes(g.reduce_output_bytes):>11}  {_yes(g.reshard_after_forward)}"
        )
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _comm_table(collectives: tuple[CollectivePlan, ...], all_groups: bool) -> list[str]:
    if not collectives:
        return ["collectives: none (one rank per shard group)"]
    # Stable: the groups' order within an axis and kind.
    ordered = sorted(collectives, key=lambda c: (c.axis, c.kind))
    keys = [(c.kind, c.axis, c.group_size, c.sent_bytes, c.calls) for c in ordered]
    runs = _runs([c.group for c in ordered], keys, not all_groups)
    labels = [label + (f" (x{count})" if count > 1 else "") for label, _, count in runs]
    width = max([28, *(len(label) for label in labels)])
    lines = [
        f"{'collective':<15} {'axis':<12} {'group':<{width}} {'ranks':>5} {'sent/call':>11} "
        f"{'calls':>5} {'sent/step':>11}"
    ]
    for label, (_, i, count) in zip(labels, runs, strict=True):
        c = ordered[i]
        lines.append(
            f"{c.kind:<15} {c.axis:<12} {label:<{width}} {c.group_size:>5} "
            f"{format_bytes(c.sent_bytes):>11} {c.calls:>5} "
            f"{format_bytes(c.sent_bytes_per_step * count):>11}"
        )
    return lines


def _comm_totals(result: Plan, bandwidth: Bandwidth | None) -> list[str]:
    ratio = result.sent_over_theory
    versus = f" (theory {format_bytes(result.theory_sent_bytes)}, x{ratio:.4f})" if ratio else ""
    axes = []
    if len(result.sent_bytes_by_axis) > 1:
        parts = ", ".join(f"{a} {format_bytes(n)}" for a, n in result.sent_bytes_by_axis.items())
        axes = [f"  by mesh axis: {parts}"]
        versus = versus.replace("(theory", "(data-parallel axes' theory")
    return [
        f"sent per rank per step: {format_bytes(result.sent_bytes_per_step)}{versus}",
        *axes,
        _time_line(result, bandwidth),
    ]


def _time_line(result: Plan, bandwidth: Bandwidth | None) -> str:
    if bandwidth is not None and bandwidth.gbps is None:
        return f"communication time: not estimated ({bandwidth.detail})"
    given = bandwidth is None or bandwidth.source == "given"
    where = "" if given or bandwidth is None else f" ({bandwidth.detail})"
    return (
        f"communication time at {result.options.bandwidth_gbps:.3g} GB/s{where}: "
        f"{_milliseconds(result.comm_seconds)} (not overlapped)"
    )


def _milliseconds(seconds: float) -> str:
    """Milliseconds with three significant digits, so a small plan does not read 0.0 ms."""
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def _memory_table(result: Plan) -> list[str]:
    memory = result.memory
    peak = memory.peak
    where = f"{peak.phase.value}, {peak.label}" + (f" in {peak.module}" if peak.module else "")
    lines = [
        f"memory per rank (rank {result.options.rank}); peak during {where}",
        f"{'category':<18} {'at peak':>11} {'max':>11}",
    ]
    for category in Category:
        lines.append(
            f"{category.value:<18} {format_bytes(peak.by_category[category]):>11} "
            f"{format_bytes(memory.category_max[category]):>11}"
        )
    lines.append(f"{'total':<18} {format_bytes(peak.total):>11}")
    if result.options.on_cuda:  # what torch's allocator would hold beside the live bytes
        lines.append(
            f"on CUDA (torch's caching allocator): allocated {format_bytes(memory.allocated_peak)}"
            f", reserved {format_bytes(memory.reserved_peak)} at their peaks"
        )
    if not result.activations_traced:
        lines.append("activations not counted: pass --inputs to trace a forward on meta")
    elif result.tp_degree > 1:
        lines.append("activations: those of the model without tensor parallelism (an upper bound)")
    lines.append(
        "theory, sharded params + grads + optimizer state: "
        f"{format_bytes(result.theory_memory_bytes)}"
    )
    return lines
