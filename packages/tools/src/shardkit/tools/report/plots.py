"""PNG plots of a run: memory over time by category, and compute against communication.

matplotlib is an optional dependency (the ``plots`` extra), imported only when a plot is drawn.
The figures are built on ``matplotlib.figure.Figure`` with the Agg canvas directly, never
through pyplot, so drawing a report neither switches the user's backend nor leaves figures in
pyplot's global registry.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.tools.records import Category, MemoryReport, Phase, RankReport
from shardkit.tools.report.text import module_label
from shardkit.tools.units import BYTE_UNITS, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["MAX_RANKS", "TIMELINE_STEPS", "plot_memory", "plot_timeline"]

logger = logging.getLogger(__name__)

MAX_RANKS = 16
"""Ranks drawn per figure; more would make rows too thin to read (the rest are logged)."""
TIMELINE_STEPS = 3
"""Steps the timeline shows by default: the last ones, past any warm-up."""

_CATEGORY_COLORS = {
    Category.SHARDED_PARAMS: "#1f77b4",
    Category.UNSHARDED_PARAMS: "#aec7e8",
    Category.GRADIENTS: "#ff7f0e",
    Category.OPTIMIZER_STATE: "#2ca02c",
    Category.ACTIVATIONS: "#9467bd",
    Category.COMM_BUFFERS: "#8c564b",
    Category.OTHER: "#c7c7c7",
}
_PHASE_COLORS = {
    Phase.FORWARD: "#4c9be8",
    Phase.BACKWARD: "#2ca02c",
    Phase.OPTIMIZER: "#ff9f1c",
    Phase.OTHER: "#bbbbbb",
}
_COMM_COLOR = "#b39ddb"
_EXPOSED_COLOR = "#d62728"


def _new_figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            f'plots need matplotlib ({err}): pip install "shardkit-tools[plots]"'
        ) from err
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself: savefig renders with Agg, whatever pyplot uses
    return fig


def _shown(reports: Sequence[RankReport], what: str) -> list[RankReport]:
    ordered = sorted(reports, key=lambda r: r.rank)
    if len(ordered) > MAX_RANKS:
        rest = [r.rank for r in ordered[MAX_RANKS:]]
        logger.info("%s: drawing the first %d ranks; left out ranks %s", what, MAX_RANKS, rest)
    return ordered[:MAX_RANKS]


def plot_memory(reports: Sequence[RankReport], path: str | os.PathLike[str]) -> Path:
    """Live memory over time, stacked by category, one subplot per rank, peak annotated.

    Args:
        reports: One report per rank; ranks without a memory timeline are left out.
        path: The PNG to write.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: No rank has a memory timeline.
    """
    with_memory = [r for r in reports if r.memory is not None and r.memory.timeline]
    if not with_memory:
        raise ValueError("no rank recorded a memory timeline, so there is no memory plot")
    shown = _shown(with_memory, "memory plot")
    highest = max(s.total for r in shown if r.memory for s in [*r.memory.timeline, r.memory.peak])
    # One unit for every rank, the largest that keeps the peak at 1 or more.
    unit = [u for u in BYTE_UNITS if u[1] <= max(highest, 1)][-1]
    fig = _new_figure(10.0, 1.2 + 2.4 * len(shown))
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    for ax, report in zip(axes, shown, strict=True):
        assert report.memory is not None  # filtered above
        _draw_memory(ax, report.rank, report.memory, unit)
    axes[-1].set_xlabel("seconds since the tracker started")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # ranks may use different categories: one legend entry for each
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="outside upper center", ncols=min(4, len(labels)))
    return _save(fig, path)


def _draw_memory(ax: Axes, rank: int, memory: MemoryReport, unit: tuple[str, float]) -> None:
    name, size = unit
    timeline = memory.timeline
    present = [c for c in Category if any(s.by_category.get(c, 0) for s in timeline)]
    # Memory holds its value until the next sample: draw steps, not slopes between samples.
    times = [s.t_s for s in timeline]
    xs = [times[0], *(t for t in times[1:] for _ in range(2))]
    stacks = []
    for category in present:
        values = [s.by_category.get(category, 0) / size for s in timeline]
        stacks.append([values[0], *(v for pair in itertools.pairwise(values) for v in pair)])
    if present:
        ax.stackplot(
            xs,
            *stacks,
            labels=[c.value for c in present],
            colors=[_CATEGORY_COLORS[c] for c in present],
            linewidth=0,
        )
    peak = memory.peak
    ax.axvline(peak.t_s, color="black", linestyle="--", linewidth=0.8)
    ax.annotate(
        f"peak {format_bytes(peak.total)}\n"
        f"{peak.phase.value}: {module_label(peak.module, peak.phase)}, step {peak.step}",
        xy=(peak.t_s, peak.total / size),
        xytext=(6, -4),
        textcoords="offset points",
        va="top",
        fontsize=8,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "linewidth": 0},
    )
    ax.set_ylim(0, max(peak.total, max(s.total for s in timeline), 1) / size * 1.15)
    ax.set_ylabel(name)
    ax.set_title(f"rank {rank} ({memory.device}): live memory by category", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def plot_timeline(
    reports: Sequence[RankReport],
    path: str | os.PathLike[str],
    *,
    steps: Sequence[int] | None = None,
) -> Path:
    """Per rank, a row of compute phases above a row of collectives, exposed waits in red.

    Args:
        reports: One report per rank.
        path: The PNG to write.
        steps: The steps to draw; by default the last :data:`TIMELINE_STEPS` that ran a
            forward pass, so a long run stays readable.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: Nothing was recorded in the chosen steps.
    """
    recorded = sorted(
        {s.step for r in reports for s in r.spans}
        | {c.step for r in reports for c in r.collectives}
    )
    if steps is None:
        # Training steps (with a forward), not the tail after the last optimizer step.
        trained = sorted({s.step for r in reports for s in r.spans if s.phase is Phase.FORWARD})
        steps = (trained or recorded)[-TIMELINE_STEPS:]
    chosen = set(steps)
    if not chosen & set(recorded):
        raise ValueError(
            f"no phase span or collective recorded in steps {sorted(chosen)} "
            f"(recorded: {recorded or 'none'}), so there is no timeline plot"
        )
    shown = _shown(reports, "timeline plot")
    fig = _new_figure(12.0, 1.6 + 1.0 * len(shown))
    ax = fig.subplots()
    ticks: list[float] = []
    labels: list[str] = []
    for row, report in enumerate(shown):
        base = 3.0 * row  # compute at base, communication at base + 1, a gap after
        exposed = _draw_rank_timeline(ax, report, chosen, base)
        ticks += [base + 0.4, base + 1.4]
        labels += [f"rank {report.rank} compute", f"rank {report.rank} comm\nexposed {exposed}"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(3.0 * len(shown) - 0.8, -0.2)  # rank 0 on top
    # Each rank's times are on its own clock: start every row at its rank's first event.
    ax.set_xlabel("seconds since the rank's first event in these steps")
    ax.grid(axis="x", alpha=0.3)
    lo, hi = min(chosen), max(chosen)
    which = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
    ax.set_title(f"compute vs communication, {which} (red: training thread blocked on comm)")
    fig.legend(handles=_timeline_legend(), loc="outside upper center", ncols=6, fontsize=8)
    return _save(fig, path)


def _draw_rank_timeline(ax: Axes, report: RankReport, steps: set[int], base: float) -> str:
    """Draws one rank's two rows; returns its exposed time in the shown steps, as a label."""
    spans = [s for s in report.spans if s.step in steps]
    collectives = [c for c in report.collectives if c.step in steps]
    t0 = min([s.start_s for s in spans] + [c.start_s for c in collectives], default=0.0)
    for phase in Phase:
        bars = [(s.start_s - t0, s.end_s - s.start_s) for s in spans if s.phase is phase]
        if bars:
            ax.broken_barh(bars, (base, 0.8), facecolors=_PHASE_COLORS[phase], edgecolor="none")
    comm_bars = [(c.start_s - t0, c.duration_s) for c in collectives]
    ax.broken_barh(comm_bars, (base + 1.0, 0.8), facecolors=_COMM_COLOR, edgecolor="white")
    waits = [
        (c.end_s - t0 - min(c.wait_s, c.duration_s), min(c.wait_s, c.duration_s))
        for c in collectives
        if c.wait_s > 0
    ]
    ax.broken_barh(waits, (base + 1.0, 0.8), facecolors=_EXPOSED_COLOR, edgecolor="none")
    waited = sum(c.wait_s for c in collectives)
    return f"{waited * 1e3:.1f} ms"


def _timeline_legend() -> list[object]:
    from matplotlib.patches import Patch  # matplotlib is importable: a figure exists

    handles: list[object] = [Patch(color=_PHASE_COLORS[p], label=p.value) for p in Phase]
    handles.append(Patch(color=_COMM_COLOR, label="collective in flight"))
    handles.append(Patch(color=_EXPOSED_COLOR, label="exposed wait"))
    return handles


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
