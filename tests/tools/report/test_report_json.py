"""Rank reports as JSON: atomic per-rank files, loading a folder in rank order, the merged file."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest

from shardkit.tools.records import (
    AxisComm,
    RankReport,
)
from shardkit.tools.report.json_io import (
    FORMAT,
    load_merged_report,
    load_rank_reports,
    rank_report_path,
    write_merged_report,
    write_rank_report,
)
from tests.tools.report.reports import make_report, make_reports


def test_rank_file_round_trips(tmp_path: Path) -> None:
    report = make_report(rank=1)
    path = write_rank_report(rank_report_path(tmp_path / "new", 1), report)
    assert path == tmp_path / "new" / "rank-1.json"
    assert json.loads(path.read_text())["rank"] == 1
    assert load_rank_reports(tmp_path / "new") == [report]


def test_mesh_axes_round_trip(tmp_path: Path) -> None:
    report = make_report(rank=0)
    assert report.comm is not None
    tagged = [dataclasses.replace(c, axis="tp") for c in report.collectives]
    parts = [AxisComm(axis="tp", collectives=3, sent_bytes=9, comm_s=0.5, exposed_s=0.25)]
    parts.append(dataclasses.replace(parts[0], axis=None))
    steps = [dataclasses.replace(s, by_axis=parts) for s in report.comm.steps]
    comm = dataclasses.replace(report.comm, steps=steps)
    report = dataclasses.replace(report, collectives=tagged, comm=comm)
    path = write_rank_report(rank_report_path(tmp_path, 0), report)
    assert load_rank_reports(tmp_path) == [report]
    assert json.loads(path.read_text())["comm"]["steps"][0]["by_axis"][1]["axis"] is None


def test_loads_sorted_by_rank_and_skips_other_files(tmp_path: Path) -> None:
    for rank in (10, 2, 0, 1):
        write_rank_report(rank_report_path(tmp_path, rank), make_report(rank, world_size=11))
    (tmp_path / "report.json").write_text("{}")  # not a rank file
    (tmp_path / ".rank-3.json.x1y2.tmp").write_text("{half a")  # a write in progress
    (tmp_path / "rank-4.json.bak").write_text("junk")
    assert [r.rank for r in load_rank_reports(tmp_path)] == [0, 1, 2, 10]


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = rank_report_path(tmp_path, 0)
    write_rank_report(path, make_report(0))
    write_rank_report(path, make_report(0, world_size=4))  # replaces
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]
    assert load_rank_reports(tmp_path)[0].world_size == 4
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any new file, not 0600


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = rank_report_path(tmp_path, 0)
    write_rank_report(path, make_report(0))
    unserializable = dataclasses.replace(make_report(0), world_size=object())  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(TypeError):
        write_rank_report(path, unserializable)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]
    assert load_rank_reports(tmp_path) == [make_report(0)]


@pytest.mark.parametrize(
    "content",
    ['{"rank": 0,', "[" * 20_000 + "]" * 20_000],  # cut short; nested deeper than json recurses
)
def test_bad_json_names_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / "rank-0.json").write_text(content)
    with pytest.raises(ValueError, match=r"rank-0\.json is not valid JSON"):
        load_rank_reports(tmp_path)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"world_size": 2}', "missing the key 'rank'"),
        (
            '{"rank": 0, "world_size": 1, "spans": [{"module": "m", "phase": "forward", '
            '"start_s": 0, "end_s": 1, "step": 0, "colour": "red"}]}',
            "colour",
        ),
        ('{"rank": 0, "world_size": 1, "spans": [{"phase": "sideways"}]}', "sideways"),
    ],
)
def test_a_file_that_is_not_a_report_is_named(tmp_path: Path, content: str, problem: str) -> None:
    (tmp_path / "rank-0.json").write_text(content)
    with pytest.raises(ValueError, match=r"rank-0\.json is not a rank report") as err:
        load_rank_reports(tmp_path)
    assert problem in str(err.value)


def test_file_name_and_rank_must_agree(tmp_path: Path) -> None:
    write_rank_report(tmp_path / "rank-1.json", make_report(0))
    with pytest.raises(ValueError, match=r"rank-1\.json holds the report of rank 0"):
        load_rank_reports(tmp_path)


def test_two_files_of_one_rank_are_refused(tmp_path: Path) -> None:
    write_rank_report(tmp_path / "rank-1.json", make_report(1))
    write_rank_report(tmp_path / "rank-01.json", make_report(1))
    with pytest.raises(ValueError, match="both hold rank 1"):
        load_rank_reports(tmp_path)


def test_missing_folder_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_rank_reports(tmp_path / "nowhere")
    assert load_rank_reports(tmp_path) == []


def test_missing_ranks_are_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_rank_report(rank_report_path(tmp_path, 1), make_report(1, world_size=4))
    with caplog.at_level(logging.WARNING, logger="shardkit.tools.report.json_io"):
        assert len(load_rank_reports(tmp_path)) == 1
    assert "no report from ranks [0, 2, 3] of 4" in caplog.text


def test_merged_report_round_trips(tmp_path: Path) -> None:
    reports = make_reports()
    path = write_merged_report(tmp_path / "report.json", list(reversed(reports)))
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["world_size"] == 2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert load_merged_report(path) == reports


def test_merged_report_refuses_other_json(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(make_report().to_dict()))  # a rank file, not a merged one
    with pytest.raises(ValueError, match="not a merged shardkit report"):
        load_merged_report(path)


def test_aligned_lines_ranks_up_on_the_wall_clock() -> None:
    from shardkit.tools.records import aligned

    early = dataclasses.replace(make_report(0, 2), clock_origin_unix_s=1000.0)
    late = dataclasses.replace(make_report(1, 2), clock_origin_unix_s=1000.5)
    a, b = aligned([early, late])
    assert a == early  # the earliest rank is the reference
    assert b.clock_origin_unix_s == 1000.0
    shift = [y.start_s - x.start_s for x, y in zip(late.collectives, b.collectives, strict=True)]
    assert shift == [pytest.approx(0.5)] * len(shift)
    assert b.spans[0].start_s == pytest.approx(late.spans[0].start_s + 0.5)
    assert b.memory is not None and late.memory is not None
    assert b.memory.peak.t_s == pytest.approx(late.memory.peak.t_s + 0.5)
    assert RankReport.from_dict(b.to_dict()) == b
    unknown = make_report(0, 1)
    assert aligned([unknown]) == [unknown]  # no origin: left as it is
