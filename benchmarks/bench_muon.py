"""Muon's training step against AdamW's, torch's Muon, a gather-everything Muon and the floor.

Issue 83's benchmark: W=2 and 4 gloo ranks, the 8M and 35M benchmark GPTs (``gpt.py``'s
"small" and "medium"), at their benchmark batch and at 8x its tokens. Every configuration of
``muon_run.py`` is built once in the same workers; each round runs one step of each, in an
order that rotates from round to round, and this rank's share of the Newton-Schulz work with
nothing else (the floor: ``muon_baselines.newton_schulz_share``), every rank's share at once
from a barrier, as in a step (at W=4 on two cores, two ranks share each core in both). Steps
start from a barrier too. A step's time is its slowest rank's, the floor's too, each timed
once a round, and every figure is a median of per-round values, so drift in the machine's
load hits all of them alike. Recorded in each result's ``extra_info``:

- each configuration's median step and its ratio to AdamW's;
- ``over_floor``: (Muon's step - AdamW's) / the floor; the target is 1.1 at most (Muon's step
  costs AdamW's plus its Newton-Schulz, nothing more);
- ``over_floor_optimizer``: the same difference taken between the optimizers' parts of the
  steps alone (each step is timed as its forward and backward, then its optimizers' step, each
  from a barrier; the first part is the same code on the same batches in every
  configuration), so that a 2 to 7 s step's own spread does not swamp a 50 ms floor;
- the peak tensor bytes per rank of one step of each (the memory tracker's), against AdamW's;
- the owner layout's prototype (``muon_owner_layout.py``), issue 83's other design:
  ``owner_over_floor_optimizer`` is (its optimizers' part - the row layout's) / the floor, the
  two moving the same bytes in the same harness, so what is left is what Muon adds there;
  ``owner_bytes`` and ``rows_bytes`` its and its peer's bytes a rank a step (no peak: the
  harness keeps the matrices whole on every rank, which no FSDP does).

Nothing is asserted on time: run it on a quiet machine. The whole grid:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/bench_muon.py -q -s``; a smoke run
that only checks it runs (a tiny GPT, W=2, two rounds; its figures mean nothing):
``MUON_QUICK=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/bench_muon.py -q -s``.
``MUON_SIZES``, ``MUON_WORLDS``, ``MUON_SCALES`` and ``MUON_ROUNDS`` pick a part of the grid.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import muon_run
from harness.pool import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
_QUICK = os.environ.get("MUON_QUICK") == "1"
# Building four 35M models and their warm-up steps at 8x the tokens take minutes at W=4 on two
# cores, beyond the harness's default (meant for tests).
_TIMEOUT_S = 1800.0


def _picked(variable: str, default: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in os.environ.get(variable, default).split(",") if x.strip())


SIZES = _picked("MUON_SIZES", "fake-tiny" if _QUICK else "small,medium")
WORLDS = tuple(int(w) for w in _picked("MUON_WORLDS", "2" if _QUICK else "2,4"))
SCALES = tuple(int(s) for s in _picked("MUON_SCALES", "1" if _QUICK else "1,8"))
ROUNDS = int(os.environ.get("MUON_ROUNDS", "2" if _QUICK else "8"))
_POINTS = [(s, w, x) for s in SIZES for w in WORLDS for x in SCALES]
_RESULTS: dict[str, dict[str, float]] = {}


def _name(size: str, world: int, scale: int) -> str:
    return f"{size}-w{world}-x{scale}"


def _max(values: list[float]) -> float:
    return max(values)


def measure(size: str, world: int, scale: int, rounds: int,
            run_rounds: Callable[[Callable[[], None], int], None]) -> dict[str, float]:  # fmt: skip
    """Median step of each configuration, their ratios to AdamW's, the floor, peak bytes."""
    configs = muon_run.CONFIGS
    kwargs: dict[str, Any] = {"size": size, "scale": scale, "configs": configs}
    run_on_ranks(world, muon_run.setup, timeout_s=_TIMEOUT_S, **kwargs)
    steps: dict[str, list[float]] = {c: [] for c in configs}
    optimizer_parts: dict[str, list[float]] = {c: [] for c in configs}
    floors: list[float] = []
    counter = [10]

    def one_round() -> None:
        counter[0] += 1
        turn = counter[0] % len(configs)
        for config in configs[turn:] + configs[:turn]:
            parts = run_on_ranks(world, muon_run.step_seconds, timeout_s=_TIMEOUT_S,
                                 config=config, step=counter[0])  # fmt: skip
            optimizer_part = _max([o for _, o in parts])
            steps[config].append(_max([f for f, _ in parts]) + optimizer_part)
            optimizer_parts[config].append(optimizer_part)
        floors.append(_max(run_on_ranks(world, muon_run.floor_seconds, timeout_s=_TIMEOUT_S)))

    run_rounds(one_round, rounds)
    peaks = {
        c: max(run_on_ranks(world, muon_run.peak_bytes, timeout_s=_TIMEOUT_S, config=c, step=1))
        for c in configs
        if c not in muon_run.LAYOUTS
    }
    layouts = {
        c: run_on_ranks(world, muon_run.layout_bytes, timeout_s=_TIMEOUT_S, config=c)[0]
        for c in muon_run.LAYOUTS
    }
    run_on_ranks(world, muon_run.teardown)
    adamw = steps["adamw"]
    out: dict[str, float] = {"floor_s": statistics.median(floors)}
    for config in configs:
        out[f"{config}_s"] = statistics.median(steps[config])
        out[f"{config}_vs_adamw"] = statistics.median(
            t / a for t, a in zip(steps[config], adamw, strict=True)
        )
        if config in peaks:
            out[f"{config}_peak_mib"] = peaks[config] / 2**20
            out[f"{config}_peak_vs_adamw"] = peaks[config] / peaks["adamw"]
    out["over_floor"] = statistics.median(
        (m - a) / f for m, a, f in zip(steps["muon"], adamw, floors, strict=True)
    )
    for config in configs:
        out[f"{config}_optimizer_s"] = statistics.median(optimizer_parts[config])
    out["over_floor_optimizer"] = statistics.median(
        (m - a) / f
        for m, a, f in zip(optimizer_parts["muon"], optimizer_parts["adamw"], floors, strict=True)
    )
    out["owner_over_floor_optimizer"] = statistics.median(
        (o - r) / f
        for o, r, f in zip(optimizer_parts["owner"], optimizer_parts["rows"], floors, strict=True)
    )
    for config, (sent, padding) in layouts.items():
        out[f"{config}_bytes"] = sent
        out[f"{config}_padding"] = padding
    return out


@pytest.mark.parametrize(("size", "world", "scale"), _POINTS,
                         ids=[_name(*p) for p in _POINTS])  # fmt: skip
def test_muon_step(benchmark: Any, size: str, world: int, scale: int) -> None:
    def run_rounds(one_round: Callable[[], None], rounds: int) -> None:
        benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=1)

    result = measure(size, world, scale, ROUNDS, run_rounds)
    _RESULTS[_name(size, world, scale)] = result
    benchmark.extra_info.update({"method": "rounds of every configuration", **result})


def test_summary() -> None:
    """Write and print the table (nothing is asserted: the machine is noisy)."""
    columns = ("muon", "torch-muon", "gather")
    lines = [
        "| point | AdamW (ms) | Muon (ms) | over the floor: steps | over the floor: optimizer "
        "parts | optimizers' part: AdamW / Muon (ms) | Muon / AdamW | torch's Muon / AdamW "
        "| gather-everything / AdamW | Newton-Schulz floor (ms) | peak: Muon / AdamW "
        "| owner layout (prototype) over the floor: optimizer parts | optimizers' part: rows / "
        "owner (ms) | owner layout's bytes / rows' |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in _RESULTS.items():
        ratios = " | ".join(f"{r[f'{c}_vs_adamw']:.2f}" for c in columns)
        lines.append(
            f"| {name} | {r['adamw_s'] * 1e3:.0f} | {r['muon_s'] * 1e3:.0f} | "
            f"{r['over_floor']:.2f} | {r['over_floor_optimizer']:.2f} | "
            f"{r['adamw_optimizer_s'] * 1e3:.1f} / {r['muon_optimizer_s'] * 1e3:.1f} | "
            f"{ratios} | {r['floor_s'] * 1e3:.0f} | "
            f"{r['muon_peak_vs_adamw']:.2f} | {r['owner_over_floor_optimizer']:.2f} | "
            f"{r['rows_optimizer_s'] * 1e3:.1f} / {r['owner_optimizer_s'] * 1e3:.1f} | "
            f"{r['owner_bytes'] / r['rows_bytes']:.3f} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if _RESULTS and not _QUICK:
        out = ROOT / "benchmarks" / ".results" / "muon.md"
        out.parent.mkdir(exist_ok=True)
        out.write_text(table + "\n")
