"""PNG plots and the report folder: real PNGs, pyplot left alone, plots skipped cleanly."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import sys
from pathlib import Path

import pytest

from shardkit.tools.report.folder import REPORT_FILES, skipped_plots, write_report
from shardkit.tools.report.json_io import load_merged_report
from shardkit.tools.report.plots import MAX_RANKS, plot_memory, plot_timeline
from tests.tools.report.reports import make_report, make_reports

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, from its header; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes: an empty figure?"
    return width, height


def test_memory_plot_has_a_subplot_per_rank(tmp_path: Path) -> None:
    one = plot_memory([make_report(0)], tmp_path / "one.png")
    three = plot_memory(make_reports(world_size=3), tmp_path / "three.png")
    (w1, h1), (w3, h3) = _png_size(one), _png_size(three)
    assert w1 == w3 == 1000  # 10 inches at 100 dpi
    assert h3 > h1 + 400  # a 2.4-inch row per rank


def test_timeline_plot(tmp_path: Path) -> None:
    path = plot_timeline(make_reports(), tmp_path / "deep" / "timeline.png")
    assert path.parent.name == "deep"
    assert _png_size(path)[0] == 1200


def test_timeline_plot_chooses_steps(tmp_path: Path) -> None:
    plot_timeline([make_report(steps=5)], tmp_path / "last.png")  # the last 3 steps
    plot_timeline([make_report(steps=5)], tmp_path / "first.png", steps=[0])
    assert _png_size(tmp_path / "first.png") == _png_size(tmp_path / "last.png")
    with pytest.raises(ValueError, match=r"no phase span or collective recorded in steps \[7\]"):
        plot_timeline([make_report()], tmp_path / "none.png", steps=[7])


def test_memory_plot_needs_memory(tmp_path: Path) -> None:
    bare = dataclasses.replace(make_report(), memory=None)
    with pytest.raises(ValueError, match="no rank recorded a memory timeline"):
        plot_memory([bare], tmp_path / "memory.png")
    # A rank without memory is left out, not an error.
    assert _png_size(plot_memory([bare, make_report(1)], tmp_path / "memory.png"))


def test_many_ranks_are_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reports = make_reports(world_size=MAX_RANKS + 2)
    with caplog.at_level(logging.INFO, logger="shardkit.tools.report.plots"):
        plot_timeline(reports, tmp_path / "timeline.png")
    assert f"left out ranks [{MAX_RANKS}, {MAX_RANKS + 1}]" in caplog.text


def test_pyplot_is_left_alone(tmp_path: Path) -> None:
    import matplotlib

    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    plot_memory(make_reports(), tmp_path / "memory.png")
    plot_timeline(make_reports(), tmp_path / "timeline.png")
    assert matplotlib.get_backend() == backend
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


def test_missing_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r'pip install "shardkit-tools\[plots\]"'):
        plot_memory(make_reports(), tmp_path / "memory.png")


def test_write_report_writes_every_file(tmp_path: Path) -> None:
    reports = make_reports()
    written = write_report(tmp_path / "prof", list(reversed(reports)))
    assert {k: p.name for k, p in written.items()} == REPORT_FILES
    assert all(p.parent == tmp_path / "prof" for p in written.values())
    assert "communication per step" in written["summary"].read_text()
    assert load_merged_report(written["json"]) == reports
    assert json.loads(written["trace"].read_text())["traceEvents"]
    _png_size(written["memory_plot"])
    _png_size(written["timeline_plot"])


def test_write_report_skips_plots_it_cannot_draw(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reports = [dataclasses.replace(r, memory=None) for r in make_reports()]
    with caplog.at_level(logging.WARNING, logger="shardkit.tools.report.folder"):
        written = write_report(tmp_path, reports)
    assert "memory_plot" not in written
    assert "timeline_plot" in written
    assert "skipping memory.png: no rank recorded memory" in caplog.text
    bare = [dataclasses.replace(r, spans=[], collectives=[]) for r in reports]
    assert set(write_report(tmp_path / "bare", bare)) == {"summary", "json", "trace"}


def test_write_report_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="shardkit.tools.report.folder"):
        written = write_report(tmp_path, make_reports())
    assert set(written) == {"summary", "json", "trace"}
    for name in ("memory.png", "timeline.png"):  # each says why, and what brings matplotlib
        assert f"skipping {name}: matplotlib is not installed" in caplog.text
    assert 'pip install "shardkit-tools[plots]"' in caplog.text
    reasons = skipped_plots(make_reports())
    assert set(reasons) == {"memory_plot", "timeline_plot"}
    assert all(r.endswith('pip install "shardkit-tools[plots]"') for r in reasons.values())


def test_write_report_needs_reports(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing was recorded"):
        write_report(tmp_path, [])
