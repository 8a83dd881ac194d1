"""``make check-gpu``'s planner chunk: issue 65's predictions against a GPU's measurements.

Its own module: scripts/gpu_chunks.py, which registers it, is near the house's 450-line limit.
``benchmarks/cuda_planner_run.py`` predicts the default plan and the plan ``fit`` chooses for a
budget (a share of the default's predicted peak) of the 217M GPT at W=8, then runs rank 0 of
each on torch's fake process group on the GPU. On CUDA a row passes where the measured
``max_memory_allocated`` is within ``PEAK_TOLERANCE`` of the planner's replay of the caching
allocator (``Plan.memory.allocated_peak``: the live tensors as the allocator's blocks, each
rounded, some whole blocks larger than asked) and, for the chosen plan, the measured
``max_memory_reserved`` is within its budget (what ``--fit`` budgets on CUDA since issue 84).
The model's reserved peak beside the measured one is reported, with the live-tensor peaks and
the measured allocated over the predicted live bytes (the figure judged before the model).
On a CPU the peak judged is the live tensor bytes against the prediction. Step times are
reported, not judged:
the fake group's collectives take no time, and the profiles' efficiencies are assumptions.
The CPU smoke run (a tiny GPT) runs the same code; its peak is the live tensor bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from scripts.gpu_runner import Row, Runner

__all__ = ["PEAK_TOLERANCE", "planner", "planner_rows"]

PEAK_TOLERANCE = 0.10
"""How far the measured peak may be from the predicted one (either way), as a share of it."""

MIB = 2**20


def planner(
    device: str, size: str, world: int = 8, share: float = 0.6, steps: int = 5, warmup: int = 2
) -> Callable[[Runner], list[Row]]:
    """The chunk: both plans of ``size`` at ``world`` ranks (the fake group) on ``device``."""

    def run(runner: Runner) -> list[Row]:
        cmd = [sys.executable, "benchmarks/cuda_planner_run.py", "--device", device]
        cmd += ["--size", size, "--world", str(world), "--budget-share", str(share)]
        cmd += ["--steps", str(steps), "--warmup", str(warmup)]
        records, error = runner.run("planner", cmd, timeout=420)
        return planner_rows(records, error, device=device, size=size, world=world, share=share)

    return run


def planner_rows(
    records: list[dict[str, Any]], error: str, *, device: str, size: str, world: int, share: float
) -> list[Row]:
    """The default plan's row and the chosen plan's, from the runner's records."""
    rows = []
    for name in ("default", "chosen"):
        shown = size.upper() if size[:1].isdigit() else size  # "217M", "fake-tiny"
        label = f"planner: {shown} {name} plan, fake group W={world} ({device})"
        if name == "chosen":
            label += f" (budget {share:g} of the default's predicted peak)"
        found = [r for r in records if r.get("plan") == name]
        if not found:
            rows.append(Row(chunk="", check=label, status="error", detail=error))
            continue
        rows.append(_row(label, found[0], device))
    return rows


def _row(label: str, r: dict[str, Any], device: str) -> Row:
    if r.get("measured_peak_bytes") is None:  # nothing fits the budget: nothing was run
        why = f"the search found no plan under {r['budget_bytes'] / MIB:.1f} MiB"
        return Row(chunk="", check=label, status="fail", detail=why)
    predicted, measured = r["predicted_peak_bytes"], r["measured_peak_bytes"]
    which = "reserved" if device == "cuda" else "live tensors"
    judged = r.get("allocated_ratio", r["peak_ratio"])
    if device == "cuda":
        figures = (
            f"{r['description']}: allocated predicted {r['predicted_allocated_bytes'] / MIB:.1f}"
            f" MiB, measured {r['peak_alloc_bytes'] / MIB:.1f} MiB: {judged:.3f}; reserved "
            f"predicted {r['predicted_reserved_bytes'] / MIB:.1f} MiB, measured "
            f"{r['peak_reserved_bytes'] / MIB:.1f} MiB: {r['reserved_ratio']:.3f}; live "
            f"predicted {predicted / MIB:.1f} MiB, measured {r['live_peak_bytes'] / MIB:.1f} MiB"
            f" (allocated over predicted live: {r['peak_ratio']:.3f})"
        )
    else:
        figures = (
            f"{r['description']}: peak predicted {predicted / MIB:.1f} MiB, measured "
            f"{measured / MIB:.1f} MiB ({which}): {judged:.3f}"
        )
    figures += (
        f"; step predicted {r['predicted_step_s'] * 1e3:.1f} ms on {r['hardware']}, measured "
        f"{r['step_s'] * 1e3:.1f} ms (fake group: no communication)"
    )
    problems = []
    if abs(judged - 1.0) > PEAK_TOLERANCE:
        what = "allocated" if device == "cuda" else "peak"
        problems.append(
            f"measured {what} {judged:.3f} of the predicted, beyond {PEAK_TOLERANCE:.0%}"
        )
    if r["plan"] == "chosen":
        budget = r["budget_bytes"]
        fits = "fits" if r["fits_budget"] else "does NOT fit"
        figures += f"; {fits} its budget of {budget / MIB:.1f} MiB ({which})"
        if not r["fits_budget"]:
            held = r.get("peak_reserved_bytes", measured)
            problems.append(f"measured {which} {held} bytes above the budget of {budget}")
    status = "fail" if problems else "pass"
    return Row(chunk="", check=label, status=status, figures=figures, detail="\n".join(problems))
