"""The Chrome / Perfetto trace: one process per rank, drawable threads, times in microseconds."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from shardkit.tools.records import RankReport
from shardkit.tools.report.trace import _assign_lanes, build_trace, write_trace
from tests.tools.report.reports import STEP_S, MiB, make_report, make_reports

Event = dict[str, Any]


def _events(reports: list[RankReport]) -> list[Event]:
    # Through JSON and back: what a viewer reads.
    events: list[Event] = json.loads(json.dumps(build_trace(reports)))["traceEvents"]
    return events


def _thread_names(events: list[Event], pid: int) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid
    }


def _slices(events: list[Event], pid: int, thread: str) -> list[Event]:
    tids = {tid for tid, name in _thread_names(events, pid).items() if name.startswith(thread)}
    return [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] in tids]


def test_one_named_process_per_rank() -> None:
    events = _events(make_reports(world_size=3))
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert {e["pid"] for e in events} == {0, 1, 2}
    for pid in range(3):
        assert set(_thread_names(events, pid).values()) == {
            "steps",
            "compute",
            "communication",
            "communication 2",  # the prefetched all-gather overlaps the one before it
        }


def test_phase_spans_on_the_compute_thread_in_microseconds() -> None:
    events = _events([make_report(rank=1)])
    compute = _slices(events, 1, "compute")
    assert len(compute) == 10  # 5 spans x 2 steps
    first = {e["name"]: e for e in compute if e["args"]["step"] == 0}
    assert first["forward: blocks.0"]["ts"] == 0.0
    assert first["forward: blocks.0"]["dur"] == 10_000.0
    assert first["backward: blocks.1"]["ts"] == 20_000.0
    assert first["backward: blocks.1"]["dur"] == 15_000.0
    assert first["optimizer: (optimizer step)"]["cat"] == "optimizer"
    later = [e for e in compute if e["name"] == "forward: blocks.0" and e["args"]["step"] == 1]
    assert later[0]["ts"] == pytest.approx(STEP_S * 1e6)


def test_collectives_carry_their_details_and_exposed_wait() -> None:
    events = _events([make_report()])
    comm = [e for e in _slices(events, 0, "communication") if e["cat"] == "communication"]
    assert len(comm) == 8
    rs = next(e for e in comm if e["name"] == "reduce_scatter: blocks.0")
    assert rs["ts"] == 45_000.0
    assert rs["dur"] == pytest.approx(10_000.0)
    assert rs["args"] == {
        "kind": "reduce_scatter",
        "op": "c10d.reduce_scatter",
        "bytes": 2 * MiB,
        "wire_bytes": 4 * MiB,  # gloo's reduce-scatter: twice the payload
        "input_bytes": MiB // 2,
        "group": "0",
        "group_size": 2,
        "axis": None,
        "module": "blocks.0",
        "serves": None,
        "phase": "backward",
        "step": 0,
        "exposed_us": 2_000.0,
    }
    waits = [e for e in _slices(events, 0, "communication") if e["cat"] == "exposed"]
    assert len(waits) == 6  # 3 of the 4 collectives per step were waited on
    wait = next(w for w in waits if w["tid"] == rs["tid"] and w["ts"] >= rs["ts"])
    # The wait is the collective's tail, on its thread, nested inside it.
    assert wait["name"] == "exposed wait"
    assert wait["ts"] == pytest.approx(53_000.0)
    assert wait["ts"] + wait["dur"] == pytest.approx(rs["ts"] + rs["dur"])


def test_steps_thread() -> None:
    steps = _slices(_events([make_report()]), 0, "steps")
    assert [(e["name"], e["ts"], e["dur"]) for e in steps] == [
        ("step 0", 0.0, pytest.approx(55_000.0)),
        ("step 1", pytest.approx(60_000.0), pytest.approx(55_000.0)),
    ]


def test_every_thread_nests_properly() -> None:
    """Viewers stack a thread's slices: any two must be disjoint or one inside the other."""
    events = _events(make_reports())
    by_thread: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    for thread, slices in by_thread.items():
        for a in slices:
            for b in slices:
                a0, a1, b0, b1 = a["ts"], a["ts"] + a["dur"], b["ts"], b["ts"] + b["dur"]
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested, (thread, a["name"], b["name"])


def test_memory_counters_by_category() -> None:
    events = _events([make_report()])
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "memory [MiB]"]
    assert len(counters) == 8  # 4 samples x 2 steps
    at_peak = next(e for e in counters if e["ts"] == 30_000.0)
    assert at_peak["args"] == {
        "sharded_params": 4.0,
        "unsharded_params": 2.0,
        "gradients": 1.0,
        "optimizer_state": 0.0,  # every category the rank ever used, in every sample
        "activations": 8.0,
    }
    totals = [e for e in events if e["ph"] == "C" and e["name"] == "memory total [MiB]"]
    assert next(e for e in totals if e["ts"] == 30_000.0)["args"] == {"total": 15.0}


def test_ranks_without_data() -> None:
    bare = dataclasses.replace(make_report(1), memory=None, collectives=[], spans=[])
    events = _events([make_report(0), bare])
    assert not [e for e in events if e["pid"] == 1 and e["ph"] in ("X", "C")]
    assert [e["args"]["name"] for e in events if e["pid"] == 1 and e["name"] == "process_name"]


def test_write_trace(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "sub" / "trace.json", make_reports())
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    assert data["traceEvents"] == _events(make_reports())


@pytest.mark.parametrize(
    ("intervals", "nest", "lanes"),
    [
        ([(0, 1), (1, 2), (2, 3)], False, [0, 0, 0]),  # back to back
        ([(0, 10), (2, 4), (5, 6)], True, [0, 0, 0]),  # nested
        ([(0, 10), (2, 4), (5, 6)], False, [0, 1, 1]),
        ([(0, 4), (2, 6), (5, 8), (7, 9)], True, [0, 1, 0, 1]),  # partial overlaps
        ([(5, 6), (0, 10)], True, [0, 0]),  # any input order
        ([], False, []),
    ],
)
def test_assign_lanes(intervals: list[tuple[float, float]], nest: bool, lanes: list[int]) -> None:
    assert _assign_lanes(intervals, nest=nest) == lanes
