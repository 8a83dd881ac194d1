"""The terminal summary: units, the table formatter, and the figures each section must show."""

from __future__ import annotations

import dataclasses

import pytest

from shardkit.tools.records import CommSummary, Phase, RankReport, StepComm
from shardkit.tools.report.text import (
    format_seconds,
    format_table,
    module_label,
    summarize,
)
from shardkit.tools.track.comm_summary import by_axis
from tests.tools.report.reports import MiB, make_report, make_reports


def _line(text: str, *starts: str) -> str:
    """The one line of ``text`` whose cells begin with ``starts`` (spaces collapsed)."""
    hits = [ln for ln in text.splitlines() if ln.split()[: len(starts)] == list(starts)]
    assert len(hits) == 1, f"{starts} found on {len(hits)} lines of:\n{text}"
    return " ".join(hits[0].split())


@pytest.mark.parametrize(
    ("s", "text"),
    [(0.0, "0"), (12e-6, "12 us"), (0.0123, "12.3 ms"), (0.9994, "999.4 ms"), (61.0, "61.00 s")],
)
def test_format_seconds(s: float, text: str) -> None:
    assert format_seconds(s) == text


def test_format_table_aligns_names_left_and_numbers_right() -> None:
    table = format_table(["name", "bytes"], [["a", "1 B"], ["longer", "10.00 KiB"]])
    assert table.splitlines() == [
        "name        bytes",
        "------  ---------",
        "a             1 B",
        "longer  10.00 KiB",
    ]
    with pytest.raises(ValueError, match="row \\['x'\\] has 1 cells for 2 columns"):
        format_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align='l' has 1 letters for 2 columns"):
        format_table(["a", "b"], [], align="l")


def test_module_labels() -> None:
    assert module_label("blocks.0", Phase.FORWARD) == "blocks.0"
    assert module_label("", Phase.BACKWARD) == "(root)"
    assert module_label("", Phase.OPTIMIZER) == "(optimizer step)"
    assert module_label("", Phase.OTHER) == "(outside modules)"


def test_communication_per_step() -> None:
    text = summarize(make_reports())
    assert text.startswith("shardkit profile: 2 of 2 ranks (ranks 0, 1)\n")
    assert "vs min: payload over the theoretical minimum" in text
    assert "wire: bytes it sent under the algorithms that ran" in text
    assert text.endswith("\n")
    # The exposed time comes first, then the total in flight:
    # rank, step, collectives, payload, wire, vs min, step time, exposed (%), comm total,
    # overlapped (%), exposed/step
    header = "rank step collectives payload wire vs min step time exposed comm total overlapped"
    assert _line(text, "rank", "step") == header + " exposed/step"
    row = "0 0 4 6.00 MiB 10.00 MiB 2.00x 55.0 ms 10.0 ms (25%) 40.0 ms 30.0 ms (75%) 18%"
    assert _line(text, "0", "0") == row
    assert _line(text, "1", "0") == "1" + row[1:]
    totals = [ln for ln in text.splitlines() if ln.split()[:1] == ["all"]]
    assert [" ".join(t.split()) for t in totals] == [
        "all 8 12.00 MiB 20.00 MiB 2.00x 110.0 ms 20.0 ms (25%) 80.0 ms 60.0 ms (75%) 18%"
    ] * 2


def test_unknown_minimum_and_many_steps() -> None:
    report = make_report(steps=30)
    assert report.comm is not None
    comm = CommSummary(steps=report.comm.steps, theoretical_min_bytes=None)
    text = summarize([dataclasses.replace(report, comm=comm)])
    assert _line(text, "0", "0").split()[7] == "-"  # vs min, after "6.00 MiB 10.00 MiB"
    assert "vs min: unknown" in text
    assert "(18 more)" in text  # 30 steps: the first 6 and the last 6 shown
    assert _line(text, "29").startswith("29 4 6.00 MiB 10.00 MiB")
    assert _line(text, "all").startswith("all 120 180.00 MiB 300.00 MiB - 1.65 s 300.0 ms")


def test_collectives_grouped_by_kind_module_and_phase() -> None:
    text = summarize(make_reports())
    # 2 ranks x 2 steps = 4 calls per group; the most expensive first.
    assert _line(text, "reduce_scatter", "blocks.1") == (
        "reduce_scatter blocks.1 backward 4 8.00 MiB 16.00 MiB 0 (0%) 52.0 ms"
    )
    assert _line(text, "all_gather", "blocks.0") == (
        "all_gather blocks.0 forward 4 4.00 MiB 4.00 MiB 24.0 ms (100%) 24.0 ms"
    )
    assert _line(text, "kind") == "kind module phase calls payload wire exposed time"
    lines = text.splitlines()
    order = [
        ln.split()[:2] for ln in lines if ln.split()[:1] in (["all_gather"], ["reduce_scatter"])
    ]
    assert order[0] == ["reduce_scatter", "blocks.1"]  # 52 ms, the longest
    assert order[-1] == ["all_gather", "blocks.0"]  # 24 ms, the shortest


def test_memory_peak_by_category_and_modules() -> None:
    text = summarize(make_reports())
    assert "rank 0 (cpu): peak 15.00 MiB at 0.030 s (step 0, backward, blocks.1)" in text
    assert _line(text, "0", "sharded_params") == "0 sharded_params 4.00 MiB 27%"
    flat = [" ".join(ln.split()) for ln in text.splitlines()]
    assert flat.count("activations 8.00 MiB 53%") == 2  # ranks 0 and 1, no rank cell
    assert "optimizer_state" not in text.split("top modules")[0].split("memory at each")[1]
    assert _line(text, "blocks.1", "backward") == (
        "blocks.1 backward 15.00 MiB activations 8.00 MiB (53%) 0"
    )
    assert _line(text, "(optimizer", "step)") == (
        "(optimizer step) optimizer 14.00 MiB optimizer_state 8.00 MiB (57%) 0"
    )
    assert "allocator" not in text


def test_module_rows_take_the_highest_rank() -> None:
    low, high = make_report(0), make_report(1)
    assert high.memory is not None
    doubled = {c: 2 * n for c, n in high.memory.peak.by_category.items()}
    peak = dataclasses.replace(high.memory.peak, by_category=doubled)
    bigger = dataclasses.replace(high.memory.module_peaks[0], peak=peak)
    memory = dataclasses.replace(high.memory, module_peaks=[bigger])
    text = summarize([low, dataclasses.replace(high, memory=memory)])
    assert _line(text, "blocks.1", "backward").endswith("30.00 MiB activations 16.00 MiB (53%) 1")


def test_allocator_figures() -> None:
    report = make_report(1)
    assert report.memory is not None
    figures = {"peak_allocated": 17 * MiB, "peak_reserved": 20 * MiB}
    memory = dataclasses.replace(report.memory, allocator=figures)
    text = summarize([make_report(0), dataclasses.replace(report, memory=memory)])
    assert "allocator (CUDA caching allocator)" in text
    assert _line(text, "rank", "peak_allocated") == "rank peak_allocated peak_reserved"
    assert _line(text, "0", "-") == "0 - -"
    assert _line(text, "1", "17.00") == "1 17.00 MiB 20.00 MiB"


def test_missing_comm_and_memory() -> None:
    bare = RankReport(rank=0, world_size=1)
    text = summarize([bare])
    assert "communication per step: not recorded" in text
    assert "collectives: none recorded" in text
    assert "memory: not recorded" in text
    half = [make_report(0), dataclasses.replace(make_report(1), comm=None, memory=None)]
    text = summarize(half)
    assert "no communication summary from ranks 1" in text
    assert "no memory data from ranks 1" in text
    assert "(summed over 2 ranks;" in text  # rank 1's collectives still count


def test_a_step_without_time_shows_no_percentages() -> None:
    step = StepComm(step=0, collectives=0, sent_bytes=0, comm_s=0.0, exposed_s=0.0, step_s=0.0)
    report = RankReport(
        rank=0, world_size=1, comm=CommSummary(steps=[step], theoretical_min_bytes=0)
    )
    # No wire bytes known: '-'.
    assert _line(summarize([report]), "0", "0") == "0 0 0 0 B - - 0 0 (-) 0 0 (-) -"


def test_no_reports() -> None:
    assert summarize([]) == "shardkit profile: no rank reports\n"


def test_collectives_are_grouped_by_the_module_they_serve_where_known() -> None:
    report = make_report(0, 1)
    served = [
        dataclasses.replace(c, serves="blocks.7") if c.module == "blocks.0" else c
        for c in report.collectives
    ]
    text = summarize([dataclasses.replace(report, collectives=served)])
    assert _line(text, "all_gather", "blocks.7").startswith("all_gather blocks.7 forward")
    assert "all_gather blocks.0" not in " ".join(text.split())


def test_communication_by_mesh_axis() -> None:
    report = make_report(0, 1)
    assert report.comm is not None
    # The all-gathers on the tp axis, the reduce-scatters on dp (a made-up split).
    tagged = [
        dataclasses.replace(c, axis="tp" if c.kind == "all_gather" else "dp")
        for c in report.collectives
    ]
    steps = [
        dataclasses.replace(s, by_axis=by_axis([c for c in tagged if c.step == s.step]))
        for s in report.comm.steps
    ]
    comm = dataclasses.replace(report.comm, steps=steps)
    text = summarize([dataclasses.replace(report, collectives=tagged, comm=comm)])
    # Per step, tp: 2 MiB, busy 12 ms of which 8 exposed; dp: 4 MiB, busy 23 ms, 2 exposed.
    assert _line(text, "rank", "axis") == "rank axis collectives payload exposed comm total"
    assert _line(text, "0", "dp") == "0 dp 4 8.00 MiB 4.0 ms (9%) 46.0 ms"
    assert _line(text, "tp") == "tp 4 4.00 MiB 16.0 ms (67%) 24.0 ms"
    assert _line(text, "all_gather", "tp", "blocks.0").startswith(
        "all_gather tp blocks.0 forward 2 2.00 MiB"
    )
    assert "collectives by kind, axis, module and phase" in text
    # Without mesh axes neither the section nor the column shows.
    plain = summarize(make_reports())
    assert "by mesh axis" not in plain and "kind, module and phase" in plain


def test_a_computed_minimum_says_how() -> None:
    report = make_report(0, 1)
    assert report.comm is not None
    comm = dataclasses.replace(report.comm, minimum_computed=True)
    text = summarize([dataclasses.replace(report, comm=comm)])
    assert "vs min: payload over the theoretical minimum for the model" in text
    assert "computed from its FSDP groups" in text
    restored = RankReport.from_dict(dataclasses.replace(report, comm=comm).to_dict())
    assert restored.comm is not None and restored.comm.minimum_computed
    assert [c.wire_bytes for c in restored.collectives] == [
        c.wire_bytes for c in report.collectives
    ]
    assert "computed from" not in summarize([report])
