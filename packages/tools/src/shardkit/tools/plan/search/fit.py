"""``shardkit-plan --fit BUDGET``: the search, the chosen plan's check, and what to paste.

:func:`fit` runs the search (``search``) for a model built on the meta device, on a hardware
profile, and hands back the result with the chosen plan's predictions; :func:`format_fit`
writes what the command prints: the chosen plan with its predicted peak and step time and
where the time goes, the runners-up with why each lost, what would fit when nothing does,
the check on the fake process group when one ran, and the plan as a ``parallelize``
function to paste into a training script; :func:`fit_json` the same as one JSON document
(``--fit --json``), with the chosen plan as ``--plan-out`` writes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from shardkit.core import ReducePrecision
from shardkit.tools.plan.apply.launch_check import PlanCheck, check_plan
from shardkit.tools.plan.apply.parallelize_source import parallelize_source
from shardkit.tools.plan.apply.plan_json import dump_plan, plan_document
from shardkit.tools.plan.dtype_names import DTYPE_NAMES
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.search.budget import format_bytes, parse_budget
from shardkit.tools.plan.search.candidates import Precision, model_shape
from shardkit.tools.plan.search.evaluator import PlannedChoice, planner_evaluator
from shardkit.tools.plan.search.search import SearchResult, SearchSpace, search
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.plan.timing.calibrate import calibrate
from shardkit.tools.plan.timing.hardware import H100, PROFILES, Hardware
from shardkit.tools.plan.trace_cache import TraceCache

__all__ = ["Fit", "fit", "fit_json", "format_fit", "parse_precision", "run_fit"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """A search's answer, with what the command prints beside it."""

    result: SearchResult
    hardware: Hardware
    world_size: int
    seconds: float
    """How long the search took."""
    chosen: PlannedChoice | None
    """The chosen plan's predictions (None when nothing fits)."""
    traces: int
    """Meta-device traces the search ran (the rest of its plans reused one)."""
    check: PlanCheck | None = None
    """The chosen plan run on the fake process group, when checked."""
    larger_worlds: tuple[tuple[int, int], ...] = ()
    """When nothing fits: (world size, peak) of the plan that came closest on 2, 4 and 8
    times as many ranks (the sharded state shrinks as 1/W; activations do not)."""
    budget_counts: Literal["reserved", "live"] = "live"
    """What the budget was compared with: 'reserved', the segments torch's CUDA caching
    allocator would hold (a plan for CUDA: ``PlanOptions.on_cuda``); 'live', the live
    tensor bytes (a CPU plan)."""

    @property
    def plan(self) -> ShardingPlan | None:
        """The chosen sharding plan."""
        return self.result.best.plan if self.result.best is not None else None


def fit(
    model: nn.Module,
    *,
    world_size: int,
    budget_bytes: int,
    base: PlanOptions,
    hardware: Hardware,
    space: SearchSpace | None = None,
    progress: Callable[[str], None] | None = None,
    traces: TraceCache | None = None,
    budget_counts: Literal["reserved", "live"] | None = None,
) -> Fit:
    """Search for the fastest plan of ``model`` that fits ``budget_bytes`` on every rank.

    ``model`` is built on the meta device; ``base`` holds what the search does not choose
    (inputs, loss, optimizer, mesh, backend). See ``search.search`` for the space searched.
    ``traces`` shares the meta traces between searches of the same model and ``base`` (for
    several budgets, say); each search makes its own by default. ``budget_counts``: what
    the budget is compared with; by default what torch's CUDA caching allocator reserves for
    a plan on CUDA (``PlanOptions.on_cuda``), the live bytes for a CPU plan.
    """
    started = time.perf_counter()
    traces = traces if traces is not None else TraceCache()
    record: dict[ShardingPlan, PlannedChoice] = {}
    counts = budget_counts or ("reserved" if base.on_cuda else "live")
    # The same judge on this world size and, when nothing fits, on larger ones.
    judge = functools.partial(planner_evaluator, model, base=base, hardware=hardware, traces=traces)
    evaluate = judge(world_size=world_size, record=record, reserved=counts == "reserved")
    result = search(
        model_shape(model), evaluate, budget_bytes=budget_bytes, space=space, progress=progress
    )
    chosen = record[result.best.plan] if result.best is not None else None
    larger: list[tuple[int, int]] = []
    if result.best is None:
        for factor in (2, 4, 8):
            wider = judge(world_size=world_size * factor, reserved=counts == "reserved")
            larger.append((world_size * factor, wider(result.closest.plan).peak_bytes))
    return Fit(
        larger_worlds=tuple(larger),
        budget_counts=counts,
        result=result,
        hardware=hardware,
        world_size=world_size,
        seconds=time.perf_counter() - started,
        chosen=chosen,
        traces=len(traces),
    )


def format_fit(
    found: Fit,
    *,
    title: str,
    engine: Literal["shardkit", "torch"] = "shardkit",
    model: nn.Module | None = None,
    runners_up: int = 5,
) -> str:
    """What ``shardkit-plan --fit`` prints (``model`` lets the code index a ModuleDict by key)."""
    result = found.result
    budget = format_bytes(result.budget_bytes)
    reserved = found.budget_counts == "reserved"
    lines = [
        f"{title} on {found.world_size} ranks, budget {budget} per rank, step time on "
        f"{found.hardware.name}",
        "the budget counts what torch's CUDA caching allocator reserves (segments, rounding, "
        "cached blocks), not only live tensors"
        if reserved
        else "the budget counts live tensor bytes (a CPU plan: --backend gloo)",
        f"searched {len(result.evaluated)} plans ({found.traces} traced on the meta device) "
        f"in {found.seconds:.1f} s",
        "",
    ]
    best = result.best
    if best is None or found.chosen is None:
        closest = result.closest
        lines += [
            f"nothing fits in {budget}: the smallest {'reserved ' if reserved else ''}peak "
            "found is "
            f"{format_bytes(closest.estimate.peak_bytes)} ({closest.choice.describe()});",
            "it would fit with that budget, with offload (--allow-offload), a smaller batch, "
            "or more ranks:",
            *(
                f"  {world} ranks: peak {format_bytes(peak)}"
                f"{' (fits)' if peak <= result.budget_bytes else ''}"
                for world, peak in found.larger_worlds
            ),
        ]
        return "\n".join(lines) + "\n"
    time_ = found.chosen.time
    live = best.estimate.live_bytes
    lines += [
        f"chosen: {best.choice.describe()}",
        f"  peak {format_bytes(best.estimate.peak_bytes)} "
        + ("" if live is None else f"reserved (live tensors {format_bytes(live)}) ")
        + f"of {budget}, step "
        f"{time_.total_s * 1e3:.1f} ms: compute {time_.compute_s * 1e3:.1f} ms (recomputation "
        f"{time_.recompute_s * 1e3:.1f}), exposed communication "
        f"{time_.exposed_communication_s * 1e3:.1f} ms, optimizer "
        f"{time_.optimizer_s * 1e3:.1f} ms",
    ]
    losers = result.runners_up(runners_up)
    if losers:
        lines.append("runners-up:")
        lines += [f"  {entry.choice.describe()}: {why}" for entry, why in losers]
    if found.check is not None:
        lines += ["", *found.check.summary().splitlines()]
    plan = found.plan
    assert plan is not None
    lines += [
        "",
        f"# the plan as code ({engine}'s fully_shard):",
        parallelize_source(plan, engine=engine),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def fit_json(
    found: Fit, *, title: str, engine: Literal["shardkit", "torch"] = "shardkit"
) -> dict[str, Any]:
    """What ``shardkit-plan --fit --json`` prints: the chosen plan and the search's report.

    ``plan`` is the chosen plan as ``--plan-out`` writes it (``plan_json``: ``load_plan``
    reads it back), ``budget_counts`` what the budget was compared with ('reserved' or
    'live'), ``peak`` the chosen plan's live, allocated and reserved peaks,
    ``step_time`` its predicted step by part, ``search`` the search's report
    (``SearchResult.to_dict``, with its time, traces and, when nothing fits, the peaks on more
    ranks), ``check`` the fake-group check when one ran, ``parallelize`` the code to paste.
    docs/guide/tools.md lists every key.
    """
    plan, chosen = found.plan, found.chosen
    return {
        "factory": title,
        "world_size": found.world_size,
        "hardware": found.hardware.name,
        "fits": plan is not None,
        "budget_counts": found.budget_counts,
        "peak": None if chosen is None else _peaks(chosen),
        "plan": None if plan is None else plan_document(plan),
        "step_time": None if chosen is None else chosen.time.to_dict(),
        "search": {
            **found.result.to_dict(),
            "seconds": found.seconds,
            "traces": found.traces,
            "larger_worlds": [
                {"world_size": world, "peak_bytes": peak} for world, peak in found.larger_worlds
            ],
        },
        "check": None if found.check is None else found.check.to_dict(),
        "parallelize": None if plan is None else parallelize_source(plan, engine=engine),
    }


def _peaks(chosen: PlannedChoice) -> dict[str, int]:
    """The chosen plan's peaks: live tensors, and the CUDA caching allocator's figures."""
    memory = chosen.plan.memory
    return {
        "live_bytes": memory.peak.total,
        "allocated_bytes": memory.allocated_peak,
        "reserved_bytes": memory.reserved_peak,
    }


def parse_precision(text: str) -> Precision:
    """``PARAM[/REDUCE][+WIRE]``: ``bf16/fp32``, ``fp32``, ``bf16/fp32+int8``.

    Raises:
        ValueError: naming the text, for an unknown dtype or wire format.
    """
    head, plus, wire = text.partition("+")
    param, slash, reduce = head.partition("/")
    try:
        param_dtype = DTYPE_NAMES[param.strip().lower()]
        reduce_dtype = DTYPE_NAMES[reduce.strip().lower()] if slash else None
    except KeyError:
        raise ValueError(
            f"--precision {text!r}: dtypes are one of {', '.join(DTYPE_NAMES)}"
        ) from None
    precision = None
    if plus:
        if wire.strip() not in _WIRES:
            raise ValueError(f"--precision {text!r}: the wire is one of {', '.join(_WIRES)}")
        precision = ReducePrecision(wire_dtype=_WIRES[wire.strip()])
    return Precision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, reduce_precision=precision)


_WIRES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn"}


def run_fit(
    model: nn.Module,
    factory: Callable[[], nn.Module],
    args: argparse.Namespace,
    options: PlanOptions,
) -> int:
    """``shardkit-plan --fit``: search, check, print; returns the exit status.

    0: a plan fits (printed, and written with ``--plan-out``); 1: nothing fits (what came
    closest, and what would fit, printed); 2: bad arguments. With ``--json`` what is printed
    is :func:`fit_json`'s document, alone on stdout.
    """
    try:
        budget = parse_budget(args.fit)
        precisions = (
            tuple(parse_precision(p) for p in args.precision)
            if args.precision
            else (Precision(options.param_dtype, options.reduce_dtype, options.reduce_precision),)
        )
        space = _space(args, options, precisions)
        if options.inputs is None:
            raise ValueError("--fit needs --inputs: activations and operators come from them")
        if options.tp_plan is not None:
            raise ValueError("--fit does not search around tensor parallelism (--tp) yet")
        if options.wrap is not None or options.reshard_after_forward is not None:
            raise ValueError("--fit chooses the units and reshard_after_forward itself")
    except (ValueError, ArgumentTypeError) as err:
        sys.stderr.write(f"shardkit-plan: error: {err}\n")
        return 2
    hardware = _hardware(args.hardware, args.world_size)

    def progress(line: str) -> None:
        sys.stderr.write(f"shardkit-plan: {line}\n")

    try:
        found = fit(
            model,
            world_size=args.world_size,
            budget_bytes=budget,
            base=options,
            hardware=hardware,
            space=space,
            progress=progress,
        )
    except (ValueError, NotImplementedError, RuntimeError) as err:
        sys.stderr.write(f"shardkit-plan: cannot search {args.factory}: {err}\n")
        return 1
    plan = found.plan
    if plan is not None and args.check:
        found = _checked(found, plan, factory, args, options, progress)
    if args.plan_out and plan is not None:
        _write_atomically(Path(args.plan_out), dump_plan(plan))
    if args.json:
        document = fit_json(found, title=args.factory, engine=args.engine)
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0 if plan is not None else 1
    sys.stdout.write(format_fit(found, title=args.factory, engine=args.engine, model=model))
    if plan is None:
        return 1
    if args.plan_out:
        sys.stdout.write(
            f"\nplan written to {args.plan_out}: apply_plan(model, {args.plan_out!r})\n"
        )
    return 0


def _space(
    args: argparse.Namespace, options: PlanOptions, precisions: tuple[Precision, ...]
) -> SearchSpace:
    shard = options.mesh_shape[1] if options.mesh_shape else args.world_size
    slices: tuple[int, ...] = ()
    if args.ranks_per_node is not None:
        n = args.ranks_per_node
        if n < 2 or shard % n or n >= shard:
            raise ValueError(
                f"--ranks-per-node {n} must be at least 2 and divide the shard count {shard} "
                "(and be smaller: a slice of all of them is reshard_after_forward=True)"
            )
        slices = (n,)
    return SearchSpace(
        precisions=precisions,
        offload=(False, True) if args.allow_offload else (False,),
        reshard_slices=slices,
    )


def _hardware(name: str | None, world_size: int) -> Hardware:
    if name is None:
        return H100
    if name == "calibrate":
        return calibrate(max(2, min(world_size, 4)), threads=torch.get_num_threads())
    return PROFILES[name]


def _checked(
    found: Fit,
    plan: ShardingPlan,
    factory: Callable[[], nn.Module],
    args: argparse.Namespace,
    options: PlanOptions,
    progress: Callable[[str], None],
) -> Fit:
    """``found`` with its chosen plan run on the fake process group (one rank of W)."""
    if plan.offload:
        progress("the chosen plan offloads, which the fake-group check does not run: unchecked")
        return found
    progress(f"checking the chosen plan: rank 0 of {args.world_size} on the fake group")
    check = check_plan(
        factory,
        plan,
        world_size=args.world_size,
        inputs=options.inputs,  # type: ignore[arg-type]  # checked by run_fit
        loss=options.loss,
        base_options=options,
        # The search's own prediction, when it is the one the fake group runs.
        predicted=found.chosen.plan
        if found.chosen is not None and options.backend == "nccl" and options.rank == 0
        else None,
    )
    return replace(found, check=check)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves the old file or the new, whole."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
