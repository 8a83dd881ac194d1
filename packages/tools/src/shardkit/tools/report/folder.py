"""The report folder: every view of a profiled run, written side by side.

``write_report`` is what ``shardkit-profile`` (and the demo's ``--profile``) call once every
rank's report is in: the terminal summary as ``summary.txt``, all ranks in ``report.json``, a
Chrome / Perfetto trace as ``trace.json``, and, where matplotlib is installed, ``memory.png``
and ``timeline.png``. A plot that cannot be drawn is skipped with a warning that says why (and,
without matplotlib, which extra brings it) rather than failing the report: the text, JSON and
trace still say what happened.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from shardkit.tools.records import RankReport
from shardkit.tools.report.json_io import write_merged_report
from shardkit.tools.report.text import summarize
from shardkit.tools.report.trace import write_trace

__all__ = ["PLOTS_EXTRA", "REPORT_FILES", "skipped_plots", "write_report"]

logger = logging.getLogger(__name__)

REPORT_FILES = {
    "summary": "summary.txt",
    "json": "report.json",
    "trace": "trace.json",
    "memory_plot": "memory.png",
    "timeline_plot": "timeline.png",
}
"""What ``write_report`` writes, by the key it returns each path under."""


def write_report(folder: str | os.PathLike[str], reports: Sequence[RankReport]) -> dict[str, Path]:
    """Writes the report files of a run into ``folder`` (created if missing).

    Args:
        folder: Where the files go; the per-rank ``rank-<N>.json`` files may already be there.
        reports: One report per rank (``load_rank_reports(folder)``).

    Returns:
        The paths written, by their key in :data:`REPORT_FILES`; a skipped plot is absent.

    Raises:
        ValueError: ``reports`` is empty.
    """
    if not reports:
        raise ValueError(f"no rank reports to write into {folder}: nothing was recorded")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    reports = sorted(reports, key=lambda r: r.rank)
    summary = root / REPORT_FILES["summary"]
    summary.write_text(summarize(reports), encoding="utf-8")
    written = {
        "summary": summary,
        "json": write_merged_report(root / REPORT_FILES["json"], reports),
        "trace": write_trace(root / REPORT_FILES["trace"], reports),
    }
    written.update(_write_plots(root, reports))
    return written


PLOTS_EXTRA = 'pip install "shardkit-tools[plots]"'
"""What to run for the plots: matplotlib comes with the ``plots`` extra."""


def skipped_plots(reports: Sequence[RankReport]) -> dict[str, str]:
    """Why each plot ``write_report`` leaves out is left out, by its key in REPORT_FILES."""
    try:
        import matplotlib  # noqa: F401  (probing only: the plots import it when drawing)

        import shardkit.tools.report.plots  # noqa: F401
    except ImportError as err:
        reason = f"matplotlib is not installed ({err}); {PLOTS_EXTRA}"
        return {"memory_plot": reason, "timeline_plot": reason}
    skipped = {}
    if not any(r.memory is not None and r.memory.timeline for r in reports):
        skipped["memory_plot"] = "no rank recorded memory"
    if not any(r.spans or r.collectives for r in reports):
        skipped["timeline_plot"] = "no phase spans or collectives"
    return skipped


def _write_plots(root: Path, reports: Sequence[RankReport]) -> dict[str, Path]:
    skipped = skipped_plots(reports)
    for key, reason in skipped.items():
        logger.warning("skipping %s: %s", REPORT_FILES[key], reason)
    written: dict[str, Path] = {}
    if "memory_plot" not in skipped:
        from shardkit.tools.report.plots import plot_memory

        written["memory_plot"] = plot_memory(reports, root / REPORT_FILES["memory_plot"])
    if "timeline_plot" not in skipped:
        from shardkit.tools.report.plots import plot_timeline

        written["timeline_plot"] = plot_timeline(reports, root / REPORT_FILES["timeline_plot"])
    return written
