"""Precision-aware reduction: each mode's error against float64 as W grows, and its plot.

The demo GPT's real gradients at W = 2 to 64, reduced in one process with real arithmetic
(``reduce_precision_study``). Prints the table of docs/performance.md and draws
``docs/images/reduce-precision-error.png``:

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/bench_reduce_precision.py -q -s
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.reduce_precision_study import ModeError, study

PLOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "reduce-precision-error.png"


def _plot(found: list[ModeError], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series: dict[str, dict[int, float]] = defaultdict(dict)
    for e in found:
        series[e.mode][e.world] = e.rms
    figure = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for mode, points in series.items():
        worlds = sorted(points)
        axes.plot(worlds, [points[w] for w in worlds], marker="o", label=mode)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("world size W (ranks summed)")
    axes.set_ylabel("RMS relative error vs float64")
    axes.set_title("Reduced gradient of the demo GPT: error by reduction mode")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def test_reduce_precision_error_by_world(benchmark: Any) -> None:
    found: list[ModeError] = []

    def run() -> None:
        found[:] = study()

    benchmark.pedantic(run, rounds=1, iterations=1)
    worlds = sorted({e.world for e in found})
    out = ["", "RMS / max relative error of the reduced gradient vs float64 (demo GPT):"]
    out.append(f"{'mode':<34}" + "".join(f"{'W=' + str(w):>20}" for w in worlds))
    by_mode: dict[str, dict[int, ModeError]] = defaultdict(dict)
    for e in found:
        by_mode[e.mode][e.world] = e
        benchmark.extra_info[f"{e.mode} W{e.world}"] = [e.rms, e.max]
    for mode, row in by_mode.items():
        cells = "".join(f"{row[w].rms:>10.2e}/{row[w].max:<9.2e}" for w in worlds)
        out.append(f"{mode:<34}{cells}")
    _plot(found, PLOT)
    out.append(f"plot: {PLOT}")
    sys.stdout.write("\n".join(out) + "\n")
