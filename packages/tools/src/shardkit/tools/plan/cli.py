"""``shardkit-plan``: plan per-rank memory and communication of FSDP training, from the shell.

    shardkit-plan shardkit.tools.examples:llama_8b --world-size 64 --param-dtype bf16
        --reduce-dtype fp32 --inputs shardkit.tools.examples:llama_8b_inputs

FACTORY is ``module:function``: a function returning the model. It is called inside
``torch.device("meta")``, so the model is built without allocating (a factory that places a
tensor on a device of its own is refused, naming it). The current directory is importable, as with
``python -m``. With tensor parallelism, ``--tp N --tp-plan module:function`` names a function
of the model returning the plan ``parallelize_module`` would get (and ``--inputs``). Prints
tables (groups, collectives, memory by category) or, with ``--json``,
:meth:`shardkit.tools.plan.planner.Plan.to_dict`. Exit status: 0 planned, 1 the model could not be
planned, 2 bad arguments (including a factory that cannot be imported).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.tools.plan.bandwidth import Bandwidth, default_bandwidth, gloo_bandwidth
from shardkit.tools.plan.meta_build import NotAModuleError, OffMetaError, build_on_meta
from shardkit.tools.plan.options import OPTIMIZER_STATES, PlanOptions
from shardkit.tools.plan.planner import Plan, plan
from shardkit.tools.plan.records import CollectivePlan, GroupPlan
from shardkit.tools.records import Category
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS, format_bytes

__all__ = ["format_plan", "load_factory", "main"]

_DTYPES = {
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


class FactoryError(Exception):
    """A FACTORY argument that cannot be imported or used."""


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` (the function may be dotted: ``Cls.build``).

    Raises:
        FactoryError: naming ``spec``, when it is malformed, cannot be imported or is not
            callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"{spec!r} is not of the form module:function")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised at import
        raise FactoryError(f"cannot import module {module_name!r} of {spec!r}: {err}") from err
    for part in attr.split("."):
        if not hasattr(target, part):
            raise FactoryError(f"{spec!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise FactoryError(f"{spec!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]  # checked callable just above


def _build_model(spec: str) -> nn.Module:
    """The model of ``spec``, built under ``torch.device("meta")``.

    Raises:
        FactoryError: the factory raised, or returned no ``nn.Module``.
        OffMetaError: a parameter or buffer escaped the meta device (named).
    """
    factory = load_factory(spec)
    try:
        return build_on_meta(factory, repr(spec))
    except (NotAModuleError, OffMetaError):
        raise
    except Exception as err:
        raise FactoryError(f"{spec!r} raised {type(err).__name__}: {err}") from err


def _check_wrap(model: nn.Module, wrap: frozenset[str] | None) -> None:
    """Refuses --wrap class names that no module of the model has (a typo wraps nothing)."""
    if wrap is None:
        return
    classes = {type(m).__name__ for m in model.modules()}
    unknown = sorted(wrap - classes)
    if unknown:
        raise ValueError(
            f"--wrap names {', '.join(unknown)}, which no module of the model is an instance "
            f"of (its classes: {', '.join(sorted(classes))})"
        )


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        known = ", ".join(_DTYPES)
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r} (one of {known})") from None


def _mesh(text: str) -> tuple[int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        replicas, shard = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh wants REPLICAS,SHARD, got {text!r}") from None
    return replicas, shard


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit-plan",
        description="Predict per-rank peak memory by category and bytes per collective of "
        "FSDP training (shardkit's engine), without allocating the model.",
    )
    parser.add_argument("factory", metavar="FACTORY", help="module:function returning the model")
    parser.add_argument("--world-size", type=int, required=True, help="ranks in all")
    parser.add_argument("--mesh", type=_mesh, help="HSDP mesh REPLICAS,SHARD (product: world / tp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument(
        "--tp-plan", metavar="FACTORY", help="module:function mapping the model to its TP plan"
    )
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="free parameters after forward (default: yes, except the root)",
    )
    parser.add_argument("--param-dtype", type=_dtype, help="dtype of gathered parameters")
    parser.add_argument("--reduce-dtype", type=_dtype, help="dtype of gradient reduction")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument("--inputs", metavar="FACTORY", help="module:function returning inputs")
    parser.add_argument("--loss", metavar="FACTORY", help="module:function mapping output to loss")
    parser.add_argument(
        "--wrap",
        metavar="CLASSES",
        help="comma-separated class names to shard one by one (default: every element of an "
        "nn.ModuleList, such as a decoder's blocks: repeated blocks are wrapped without "
        "--wrap; the output lists the units chosen)",
    )
    parser.add_argument(
        "--bandwidth-gbps",
        type=float,
        help=f"GB/s per rank for the communication time (default: {DEFAULT_BANDWIDTH_GBPS:g} "
        "on nccl; on gloo, measured on this machine and cached, see --no-calibrate)",
    )
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="on gloo without --bandwidth-gbps: measure nothing, and print no time",
    )
    parser.add_argument("--rank", type=int, default=0, help="whose memory to report")
    parser.add_argument("--all-groups", action="store_true", help="list groups one by one")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardkit-plan``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: the user's modules import
    try:
        model = _build_model(args.factory)
    except OffMetaError as err:
        sys.stderr.write(f"shardkit-plan: cannot plan {args.factory}: {err}\n")
        return 1
    except (FactoryError, NotAModuleError) as err:
        sys.stderr.write(f"shardkit-plan: error: {err}\n")
        return 2
    bandwidth = _bandwidth(args)
    try:
        wrap = None if args.wrap is None else frozenset(args.wrap.split(","))
        _check_wrap(model, wrap)
        options = PlanOptions(
            mesh_shape=args.mesh,
            tp_degree=args.tp,
            tp_plan=None if args.tp_plan is None else load_factory(args.tp_plan),
            wrap=wrap,
            reshard_after_forward=args.reshard_after_forward,
            param_dtype=args.param_dtype,
            reduce_dtype=args.reduce_dtype,
            optimizer=args.optimizer,
            inputs=None if args.inputs is None else load_factory(args.inputs),
            loss=None if args.loss is None else load_factory(args.loss),
            bandwidth_gbps=bandwidth.gbps or DEFAULT_BANDWIDTH_GBPS,
            backend=args.backend,
            rank=args.rank,
        )
    except (FactoryError, ValueError, TypeError) as err:
        sys.stderr.write(f"shardkit-plan: error: {err}\n")
        return 2
    try:
        result = plan(model, world_size=args.world_size, options=options)
    except (ValueError, TypeError, RuntimeError) as err:
        sys.stderr.write(f"shardkit-plan: cannot plan {args.factory}: {err}\n")
        return 1
    if args.json:
        data = {"factory": args.factory, **result.to_dict(), "bandwidth": bandwidth.to_dict()}
        if bandwidth.gbps is None:
            data["comm_seconds"] = None
        sys.stdout.write(json.dumps(data, indent=2))
        sys.stdout.write("\n")
    else:
        text = format_plan(
            result, title=args.factory, all_groups=args.all_groups, bandwidth=bandwidth
        )
        sys.stdout.write(text)
    return 0


def _bandwidth(args: argparse.Namespace) -> Bandwidth:
    """The bandwidth asked for; on gloo, else measured (or cached), unless --no-calibrate."""
    if args.bandwidth_gbps is not None:
        return Bandwidth(gbps=args.bandwidth_gbps, source="given", detail="--bandwidth-gbps")
    if args.backend != "gloo":
        return default_bandwidth()
    if not args.calibrate:
        return Bandwidth(
            gbps=None,
            source="unavailable",
            detail="gloo runs at this machine's speed and --no-calibrate measured none: "
            "pass --bandwidth-gbps",
        )
    return gloo_bandwidth(args.world_size)


# --- tables ---------------------------------------------------------------------------------


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


def _group_table(groups: tuple[GroupPlan, ...], all_groups: bool) -> list[str]:
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
    if not result.activations_traced:
        lines.append("activations not counted: pass --inputs to trace a forward on meta")
    elif result.tp_degree > 1:
        lines.append("activations: those of the model without tensor parallelism (an upper bound)")
    lines.append(
        "theory, sharded params + grads + optimizer state: "
        f"{format_bytes(result.theory_memory_bytes)}"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
