"""The planner's measurement matrix: sixteen sharding plans of two GPTs, measured and predicted.

For the demo GPT (1.3M parameters, 8 sequences of 128 a rank) and the 35M GPT (2 sequences of
128 a rank), every plan of ``planner_configs.gpt_plans`` runs (a) on 2 gloo ranks: fastest
step time and rank 0's peak of live tensor bytes, beside the planner's predicted peak (and
step time, where a step-time model is given); (b) as rank 0 of 8 on the fake group
(``check_plan``): the peak measured there beside the predicted one. See ``planner_run``.

Prints a table per model and the Spearman rank correlation between predicted and measured
W=2 step times; writes every figure as JSON to ``$SHARDKIT_BENCH_OUT/planner.json`` (or a
temporary folder).

Usage: ``python benchmarks/bench_planner.py [demo|35m ...]``, or through pytest-benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.planner_configs import gpt_plans
from benchmarks.planner_run import (
    MODELS,
    Measurement,
    check_configs,
    cpu_step_time_model,
    measure_configs,
    next_token_loss,
    predict,
)
from benchmarks.ranking import spearman
from shardkit.tools.plan.apply.launch_check import PlanCheck
from shardkit.tools.plan.meta_build import build_on_meta
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.search.candidates import Precision
from shardkit.tools.plan.search.fit import fit
from shardkit.tools.plan.search.search import SearchSpace
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.plan.timing.hardware import Hardware

LAYERS = {"demo": 6, "35m": 8}
CHECK_WORLD = 8


def run_model(model_name: str) -> dict[str, Any]:
    """The matrix for one model: W=2 measurements, W=8 checks, the correlation, the search.

    The search (``fit``, on this machine's calibrated profile) picks a plan for a budget the
    default plan (every block a unit) does not fit (``TIGHT`` of its predicted peak) and one
    it fits (``LOOSE``); both picks are measured in the same rounds as the matrix, so each is
    compared with the fastest measured plan that fits its budget, and the loose pick with
    the default.
    """
    plans = gpt_plans(LAYERS[model_name])
    hardware, predict_ms = cpu_step_time_model(2)
    default_peak = predict(model_name, plans["per-block"], 2, "gloo").memory.peak.total
    budgets = {f"search@{share}": int(default_peak * share) for share in (TIGHT, LOOSE)}
    picks = {name: _pick(model_name, budget, hardware) for name, budget in budgets.items()}
    aliases: dict[str, str] = {}
    for name, pick in picks.items():
        # A pick that is one of the matrix's plans is measured once, under the matrix's name.
        same = next((known for known, p in plans.items() if p == pick), None)
        if pick is not None and same is None:
            plans[name] = pick
        elif same is not None:
            aliases[name] = same
    measured = measure_configs(model_name, plans, 2, predict_ms)
    checks = check_configs(model_name, plans, CHECK_WORLD)
    timed = [m for m in measured if m.predicted_ms is not None]
    rho = spearman([m.predicted_ms or 0.0 for m in timed], [m.step_ms for m in timed])
    return {
        "model": model_name,
        "hardware": hardware.to_dict(),
        "w2": [dataclasses.asdict(m) for m in measured],
        f"w{CHECK_WORLD}": {name: _check_record(c) for name, c in checks.items()},
        "spearman_step_time": rho,
        "search": [
            _judge(aliases.get(name, name), budget, measured) | {"budget_name": name}
            for name, budget in budgets.items()
        ],
        "table": table(measured, checks),
    }


TIGHT, LOOSE = 0.75, 2.0
"""Budgets as shares of the default plan's predicted peak: one it does not fit, one it does."""


def _pick(model_name: str, budget: int, hardware: Hardware) -> ShardingPlan | None:
    factory, inputs = MODELS[model_name]
    base = PlanOptions(inputs=inputs, loss=next_token_loss, backend="gloo")
    model = build_on_meta(factory, model_name)
    # The user allows bf16 parameters with a float32 reduction, as the matrix tries them.
    space = SearchSpace(precisions=(Precision(), Precision(torch.bfloat16, torch.float32)))
    found = fit(model, world_size=2, budget_bytes=budget, base=base, hardware=hardware, space=space)
    return found.plan


def _judge(name: str, budget: int, measured: list[Measurement]) -> dict[str, Any]:
    """The pick against the fastest measured plan that fits ``budget`` (and the default)."""
    by_name = {m.name: m for m in measured}
    pick = by_name.get(name)
    fitting = [m for m in measured if m.peak_bytes <= budget]
    fastest = min(fitting, key=lambda m: m.step_ms) if fitting else None
    default = by_name["per-block"]
    return {
        "pick": name,
        "budget": budget,
        "pick_step_ms": pick.step_ms if pick else None,
        "pick_peak": pick.peak_bytes if pick else None,
        "pick_fits": pick.peak_bytes <= budget if pick else None,
        "fastest_fitting": fastest.name if fastest else None,
        "fastest_fitting_ms": fastest.step_ms if fastest else None,
        "pick_over_fastest": pick.step_ms / fastest.step_ms if pick and fastest else None,
        "default_fits": default.peak_bytes <= budget,
        "pick_over_default": pick.step_ms / default.step_ms if pick else None,
    }


def _check_record(check: PlanCheck | str) -> dict[str, Any]:
    if isinstance(check, str):
        return {"error": check}
    return {
        "measured_peak": check.measured_peak,
        "predicted_peak": check.predicted_peak,
        "ratio": check.ratio,
        "collectives_match": check.collectives_match,
        "first_mismatch": check.first_mismatch,
        "ops": check.ops,
        "seconds": check.seconds,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _ratio(measured: int | None, predicted: int | None) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted:.3f}"


def table(measured: list[Measurement], checks: dict[str, PlanCheck | str]) -> str:
    """One line per plan: W=2 peak measured/predicted, step ms, W=8 peak measured/predicted."""
    head = (
        f"{'config':22} {'W2 peak MiB':>11} {'pred':>7} {'ratio':>6} {'step ms':>8} "
        f"{'pred ms':>8} {'W8 peak':>8} {'pred':>7} {'ratio':>6} {'calls':>5}"
    )
    lines = [head]
    for m in measured:
        check = checks.get(m.name)
        w8: int | None = None
        w8p: int | None = None
        calls = "-"
        if isinstance(check, PlanCheck):
            w8, w8p = check.measured_peak, check.predicted_peak
            calls = "ok" if check.collectives_match else "DIFF"
        pred_ms = "-" if m.predicted_ms is None else f"{m.predicted_ms:.0f}"
        lines.append(
            f"{m.name:22} {_mib(m.peak_bytes):>11} {_mib(m.predicted_peak):>7} "
            f"{_ratio(m.peak_bytes, m.predicted_peak):>6} {m.step_ms:>8.0f} {pred_ms:>8} "
            f"{_mib(w8):>8} {_mib(w8p):>7} {_ratio(w8, w8p):>6} {calls:>5}"
        )
    return "\n".join(lines)


def write(records: list[dict[str, Any]]) -> Path:
    """The records as JSON under ``$SHARDKIT_BENCH_OUT`` (or a temporary folder)."""
    folder = Path(os.environ.get("SHARDKIT_BENCH_OUT") or tempfile.mkdtemp(prefix="planner-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "planner.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def main(models: Sequence[str]) -> None:
    records = []
    for name in models:
        record = run_model(name)
        records.append(record)
        rho = record["spearman_step_time"]
        sys.stdout.write(f"\n{name}:\n{record['table']}\n")
        sys.stdout.write(f"Spearman (predicted vs measured W=2 step time): {rho}\n")
        for judged in record["search"]:
            sys.stdout.write(f"{json.dumps(judged)}\n")
    sys.stdout.write(f"written: {write(records)}\n")


def test_planner_matrix(benchmark: Any) -> None:
    records: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: records.extend(run_model(m) for m in MODELS), rounds=1, iterations=1)
    for record in records:
        sys.stdout.write(f"\n{record['model']}:\n{record['table']}\n")
    benchmark.extra_info["planner"] = records
    write(records)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
