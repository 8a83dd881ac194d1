"""``shardkit-plan``: plan per-rank memory and communication of FSDP training, from the shell.

    shardkit-plan shardkit.tools.examples:llama_8b --world-size 64 --param-dtype bf16
        --reduce-dtype fp32 --inputs shardkit.tools.examples:llama_8b_inputs

FACTORY is ``module:function``: a function returning the model. It is called inside
``torch.device("meta")``, so the model is built without allocating (a factory that places a
tensor on a device of its own is refused, naming it). The current directory is importable, as with
``python -m``. With tensor parallelism, ``--tp N --tp-plan module:function`` names a function
of the model returning the plan ``parallelize_module`` would get (and ``--inputs``). Prints
tables (groups, collectives, memory by category) or, with ``--json``,
:meth:`shardkit.tools.plan.plan_record.Plan.to_dict`; with ``--fit BUDGET``, the chosen plan
and the search's report, as text or (``--json``) one JSON document
(:func:`~shardkit.tools.plan.search.fit.fit_json`). Exit status: 0 planned (or a plan fits),
1 the model could not be planned (or nothing fits), 2 bad arguments (including a factory that
cannot be imported).

Next to split off: loading the user's factories (``FactoryError``, ``load_factory``,
``_build_model``) into ``plan/factory.py``, ``load_factory`` still importable from here: they
need only ``importlib`` and ``meta_build``, and ``main`` calls them before any planning.
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

from shardkit.core import ReducePrecision
from shardkit.tools.plan.checkpoint.cli import (
    add_checkpoint_arguments,
    checkpoint_cost_of,
    format_checkpoint_cost,
)
from shardkit.tools.plan.dtype_names import dtype_argument as _dtype
from shardkit.tools.plan.export.cli import add_export_arguments, export_cost_of, format_export_cost
from shardkit.tools.plan.meta_build import NotAModuleError, OffMetaError, build_on_meta
from shardkit.tools.plan.muon_step import format_muon_step, newton_schulz_costs
from shardkit.tools.plan.options import OPTIMIZER_STATES, PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.records import Bandwidth
from shardkit.tools.plan.search.fit import run_fit
from shardkit.tools.plan.tables import format_plan
from shardkit.tools.plan.timing.bandwidth import default_bandwidth, gloo_bandwidth
from shardkit.tools.plan.timing.calibrate import calibrate
from shardkit.tools.plan.timing.hardware import PROFILES, Hardware
from shardkit.tools.plan.timing.step_time import StepTime, costs_seconds, estimate_step_time
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS

__all__ = ["format_plan", "load_factory", "main"]


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
        hint = ""
        if "meta" in str(err):
            hint = (
                " (FACTORY runs under torch.device('meta'), where tensors have no data: a step "
                "that needs values, such as .to(device), loading weights or .item(), cannot "
                "run there; leave it out of the factory the planner calls)"
            )
        raise FactoryError(f"{spec!r} raised {type(err).__name__}: {err}{hint}") from err


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
    parser.add_argument(
        "factory",
        metavar="FACTORY",
        help="module:function returning the model; called under torch.device('meta'), so it "
        "may build on the default device",
    )
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
    parser.add_argument(
        "--param-dtype-override",
        metavar="FUNCTION",
        help="module:function, MixedPrecisionPolicy's param_dtype_override_fn: called on each "
        "parameter of the meta model, returns a dtype (its own keeps it out of --param-dtype) "
        "or None; it must decide from the parameter itself (its shape, its dtype), as "
        "shardkit.tools.examples:one_dim_params_in_own_dtype does",
    )
    parser.add_argument(
        "--reduce-precision",
        choices=("bfloat16", "int8", "float8_e4m3fn"),
        help="gradients on the wire in this format, summed in float32 (set_reduce_precision)",
    )
    parser.add_argument(
        "--block-size", type=int, default=256, help="elements per scale (int8, float8)"
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument("--inputs", metavar="FACTORY", help="module:function returning inputs")
    parser.add_argument(
        "--loss",
        metavar="FACTORY",
        help="module:function mapping output (or output and model) to loss",
    )
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
    parser.add_argument(
        "--hardware",
        choices=(*PROFILES, "calibrate"),
        help="predict the step time on this machine profile (h100, h200) or on this machine, "
        "measured and cached (calibrate: gloo on its CPU); needs --inputs",
    )
    fitting = parser.add_argument_group(
        "choosing a plan (--fit)",
        "search unit boundaries, per-unit reshard_after_forward, prefetch and recomputation "
        "for the fastest plan that fits; --param-dtype/--reduce-dtype/--reduce-precision fix "
        "the precision unless --precision lists the ones allowed",
    )
    fitting.add_argument(
        "--fit",
        metavar="BUDGET",
        help="device memory per rank (80GiB, 75GB, 141e9): print the fastest plan that fits, "
        "its check on the fake process group and the code to apply it; needs --inputs",
    )
    fitting.add_argument(
        "--precision",
        action="append",
        metavar="PARAM[/REDUCE][+WIRE]",
        help="a precision the search may choose (repeatable): bf16/fp32, fp32, bf16/fp32+int8",
    )
    fitting.add_argument("--allow-offload", action="store_true", help="also try CPU offload")
    fitting.add_argument(
        "--ranks-per-node",
        type=int,
        help="also try reshard_after_forward=N (a slice of N ranks kept after forward)",
    )
    fitting.add_argument("--plan-out", metavar="FILE", help="write the chosen plan as JSON")
    fitting.add_argument(
        "--engine",
        choices=("shardkit", "torch"),
        default="shardkit",
        help="whose fully_shard the printed parallelize function calls",
    )
    fitting.add_argument(
        "--no-check", dest="check", action="store_false", help="skip the fake-group check"
    )
    add_export_arguments(parser)  # each wing owns its options
    add_checkpoint_arguments(parser)
    parser.add_argument("--rank", type=int, default=0, help="whose memory to report")
    parser.add_argument("--all-groups", action="store_true", help="list groups one by one")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON; with --fit, the chosen plan and the search's report",
    )
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
            param_dtype_override_fn=None
            if args.param_dtype_override is None
            else load_factory(args.param_dtype_override),
            reduce_dtype=args.reduce_dtype,
            reduce_precision=None
            if args.reduce_precision is None
            else ReducePrecision(wire_dtype=args.reduce_precision, block_size=args.block_size),
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
    if args.fit is not None:
        return run_fit(model, load_factory(args.factory), args, options)
    try:
        result = plan(model, world_size=args.world_size, options=options)
    except (ValueError, TypeError, RuntimeError) as err:
        sys.stderr.write(f"shardkit-plan: cannot plan {args.factory}: {err}\n")
        return 1
    timed = None
    if args.hardware is not None:
        try:
            timed = _step_time(result, args.hardware)
        except (ValueError, RuntimeError) as err:
            sys.stderr.write(f"shardkit-plan: cannot time {args.factory}: {err}\n")
            return 1
    try:
        exported = export_cost_of(model, args, timed[0] if timed else None, tp_plan=options.tp_plan)
    except ValueError as err:
        sys.stderr.write(f"shardkit-plan: cannot plan the export: {err}\n")
        return 2
    try:
        saved = checkpoint_cost_of(model, args, tp_plan=options.tp_plan)
    except ValueError as err:
        sys.stderr.write(f"shardkit-plan: cannot plan the checkpoint: {err}\n")
        return 2
    if args.json:
        data = {"factory": args.factory, **result.to_dict(), "bandwidth": bandwidth.to_dict()}
        if exported is not None:
            data["export"] = exported.to_dict()
        if saved is not None:
            data["checkpoint"] = saved.to_dict()
        if bandwidth.gbps is None:
            data["comm_seconds"] = None
        if timed is not None:
            data["step_time"] = {**timed[1].to_dict(), "hardware": timed[0].to_dict()}
        sys.stdout.write(json.dumps(data, indent=2))
        sys.stdout.write("\n")
    else:
        text = format_plan(
            result, title=args.factory, all_groups=args.all_groups, bandwidth=bandwidth
        )
        sys.stdout.write(text)
        if result.muon is not None:
            hw = timed[0] if timed else None
            ns = (hw.name, costs_seconds(newton_schulz_costs(result.muon), hw)) if hw else None
            sys.stdout.write(format_muon_step(result.muon, ns))
        if timed is not None:
            sys.stdout.write(_format_step_time(*timed))
        if exported is not None:
            sys.stdout.write(format_export_cost(exported))
        if saved is not None:
            sys.stdout.write(format_checkpoint_cost(saved))
    return 0


def _step_time(result: Plan, name: str) -> tuple[Hardware, StepTime]:
    """The profile named on the command line, and the plan's step time on it."""
    if name == "calibrate":
        hardware = calibrate(max(2, min(result.world_size, 4)), threads=torch.get_num_threads())
    else:
        hardware = PROFILES[name]
    return hardware, estimate_step_time(result, hardware)


def _format_step_time(hardware: Hardware, step: StepTime) -> str:
    """The predicted step time and where it goes, in milliseconds."""
    rows = [
        ("compute (forward, backward)", step.compute_s),
        ("  of which recomputation", step.recompute_s),
        ("communication (all)", step.communication_s),
        ("  exposed", step.exposed_communication_s),
        ("offload copies", step.offload_s),
        ("optimizer step", step.optimizer_s),
        *((f"phase {name}", seconds) for name, seconds in step.phases.items()),
    ]
    lines = [f"\nStep time on {hardware.name}: {step.total_s * 1e3:.3f} ms"]
    lines += [f"  {label:<30} {seconds * 1e3:10.3f} ms" for label, seconds in rows]
    lines.append(f"  {'operators launched':<30} {step.kernels:10d}")
    return "\n".join(lines) + "\n"


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


if __name__ == "__main__":
    sys.exit(main())
