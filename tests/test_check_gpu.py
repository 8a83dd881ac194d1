"""`make check-gpu` (scripts/check_gpu.py) where there is no GPU: what it can do on a CPU.

Its GPU chunks run only on CUDA; here: the fake-group scale code on a CPU (``--cpu-smoke``),
the refusal without CUDA, and the table from saved results. About 40 s (seven processes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from scripts.check_gpu import select, table
from scripts.gpu_runner import Runner

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "check_gpu.py")


def _run(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_cpu_smoke_runs_the_fake_group_points(tmp_path: Path) -> None:
    done = _run(["--cpu-smoke"], tmp_path)
    # The table ends with each failed row's detail (its command's error): show it whole.
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    results = json.loads((tmp_path / "gpu-check" / "results.json").read_text())
    for crash in results["crashes_retried"]:  # run again and passed: a defect to find
        message = f"a smoke command was killed by a crash signal, then passed:\n{crash}"
        warnings.warn(message, stacklevel=1)
    rows = results["rows"]
    assert [r["check"] for r in rows] == [
        "fake group W=8 fake-tiny, bf16 + AC (cpu)",
        "fake group W=64 fake-tiny, bf16 + AC (cpu)",
        "fake group W=1 fake-tiny, bf16 + Float8 all-gather (torchao) (cpu)",
        "fake group W=8 fake-tiny, bf16 + Float8 all-gather (torchao) (cpu)",
        "reduce-precision cpu 4,096 elements, W=1 (bytes at W=64)",
        "memory snapshots every step, fake-tiny W=2 (cpu): step with / without, every 4th"
        " replicated whole, the gradient log between",
        "planner: fake-tiny default plan, fake group W=8 (cpu)",
        "planner: fake-tiny chosen plan, fake group W=8 (cpu) (budget 0.6 of the default's"
        " predicted peak)",
        *(
            f"export from {impl}'s fully_shard, 5m, W=1 (gloo, cpu): {what}"
            for impl in ("shardkit", "torch")
            for what in ("bit-identity, full and delta", "peak (staged + 2 buckets), time")
        ),
        "Muon on fully_shard vs torch.optim.Muon unsharded, fake-tiny fp32, W=1 (gloo, cpu),"
        " deterministic",
        "Muon (foreach elementwise opened) on fully_shard vs torch.optim.Muon unsharded,"
        " fake-tiny fp32, W=1 (gloo, cpu), deterministic",
        "Newton-Schulz batched vs one matrix at a time, fake-tiny's shapes (cpu)",
        "Muon step, fake-tiny W=1 (fp32, cpu): over AdamW vs the floor, peak",
        "Muon step, fake-tiny W=8 (bf16 + AC, fake group, cpu): over AdamW vs the floor, peak",
    ]
    assert all(r["status"] == "pass" for r in rows[6:]), rows[6:]
    # Issue 74's chunk: every sync reached all three receivers, bit-identical, deltas smaller.
    for record in results["records"]["export"]:
        assert record["identical"] and not record["errors"], record
        assert set(record["exports"].values()) == {record["syncs"]}, record
        assert 0 < record["delta_share_max"] < 0.5, record
        assert record["host_delta_s"] > 0 and record["host_full_s"] > 0, record
    # Issue 83's chunk: Muon on the sharded model has the unsharded torch.optim.Muon's bits;
    # at W=8 this rank updates its share of the whole matrices, with two collectives.
    assert "bit-identical" in rows[12]["figures"], rows[12]
    # The CPU's foreach operators are the per-tensor ones in a loop: the probe keeps the bits.
    assert "bit-identical" in rows[13]["figures"] and "may open" in rows[13]["figures"], rows[13]
    muon = {
        (r.get("config"), r.get("world")): r
        for r in results["records"]["muon"]
        if not r.get("foreach")
    }
    parities = [r for r in results["records"]["muon"] if r.get("case") == "muon-parity"]
    assert [p["foreach"] for p in parities] == [False, True], parities
    assert all(p["identical"] and p["matrices"] == 8 for p in parities), parities
    opened = [r for r in results["records"]["muon"] if r.get("foreach") and "config" in r]
    assert sorted(r["world"] for r in opened) == [1, 8], opened
    assert muon["muon", 1]["muon_stats"]["updates"] == 8, muon["muon", 1]
    assert muon["muon", 8]["muon_stats"] == {**muon["muon", 8]["muon_stats"], "updates": 1,
                                             "collectives": 2}, muon["muon", 8]  # fmt: skip
    for config in (("muon", 1), ("plain-muon", 1), ("muon", 8)):
        assert muon[config]["floor_s"] > 0 and muon[config]["optimizer_muon_s"] > 0, muon[config]
    # Issue 65's chunk: the default plan does not fit the budget (0.6 of its predicted
    # peak), the chosen one does, as predicted (live tensor bytes on a CPU: the planner's).
    default, chosen = results["records"]["planner"]
    assert not default["fits_budget"] and chosen["fits_budget"], (default, chosen)
    assert chosen["measured_peak_bytes"] < default["measured_peak_bytes"]
    for record in (default, chosen):
        assert abs(record["peak_ratio"] - 1.0) < 0.01, record
        assert record["step_s"] > 0 and record["predicted_step_s"] > 0, record
    assert "fits its budget" in rows[7]["figures"], rows[7]
    assert all(r["status"] == "pass" for r in rows[:2]), rows
    # Issue 38's chunk: both reduce-scatters and both compressed modes timed, bytes counted.
    assert rows[4]["status"] == "pass", rows[4]
    assert "bf16 wire, fp32 sum" in rows[4]["figures"] and "0.500 of fp32's" in rows[4]["figures"]
    modes = {r["mode"] for r in results["records"]["reduce-precision"]}
    assert len(modes) == 4, modes
    # Issue 40's chunk: both blocks timed on both gloo ranks, the shared memory counted.
    assert rows[5]["status"] == "pass", rows[5]
    (snapshots,) = results["records"]["memory-snapshots"]
    assert snapshots["world"] == 2 and len(snapshots["ratios"]) == 2, snapshots
    assert snapshots["gradient_log"], snapshots
    assert snapshots["shared_memory_mib_per_rank"] > 0, snapshots
    assert set(snapshots["parts"]) == {"state_dict_and_walk_s", "check_s", "copy_s"}, snapshots
    assert all(seconds > 0 for seconds in snapshots["parts"].values()), snapshots
    # The snapshots' own CPU: at least the training thread's copy, at most a step's.
    assert 0 < snapshots["snapshot_cpu_s"] < snapshots["with_s"], snapshots
    assert "the snapshots' own CPU" in rows[5]["figures"], rows[5]
    rows = rows[:4]
    # Each point ran both engines in the fake group of its world, 1/W of the parameters here.
    records = results["records"]["scale-smoke"]
    assert sorted((r["impl"], r["world"]) for r in records) == [
        ("shardkit", 8),
        ("shardkit", 64),
        ("torch", 8),
        ("torch", 64),
    ]
    local = {(r["impl"], r["world"]): r["local_params"] for r in records}
    assert local["shardkit", 8] == local["torch", 8] > local["torch", 64] == local["shardkit", 64]
    assert "| scale-smoke |" in (tmp_path / "gpu-check" / "table.md").read_text()
    if importlib.util.find_spec("torchao") is None:  # a test dependency, pinned: rarely absent
        assert all(r["status"] == "skip" and "torchao" in r["detail"] for r in rows[2:]), rows
        return
    assert all(r["status"] == "pass" for r in rows[2:]), rows
    # torchao's Float8 linears were in both engines' models, at both worlds.
    float8 = results["records"]["float8-smoke"]
    assert sorted((r["impl"], r["world"]) for r in float8) == [
        ("shardkit", 1),
        ("shardkit", 8),
        ("torch", 1),
        ("torch", 8),
    ]
    assert all(r["float8_linears"] == 8 for r in float8), float8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_and_fails(tmp_path: Path) -> None:
    done = _run([], tmp_path)
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "--cpu-smoke" in done.stderr


def test_chunks_are_picked_by_name_or_prefix() -> None:
    known = ["parity", "compile", "scale-7.5b-w8", "scale-70b-w256", "pytest-gpu"]
    assert select(["scale", "parity"], known) == ["scale-7.5b-w8", "scale-70b-w256", "parity"]
    assert select(["scale-70b-w256"], known) == ["scale-70b-w256"]
    with pytest.raises(SystemExit, match="unknown chunk 'nccl'"):
        select(["nccl"], known)


def test_table_shows_each_row_and_what_went_wrong() -> None:
    rows = [
        {"chunk": "a", "check": "x", "status": "pass", "figures": "1.00x", "seconds": 3.2,
         "detail": ""},
        {"chunk": "b", "check": "y", "status": "error", "figures": "", "seconds": 0.0,
         "detail": "exit 1\nboom"},
    ]  # fmt: skip
    text = table(rows)
    assert "| a | x | PASS | 1.00x | 3 |" in text
    assert "| b | y | ERROR |  | 0 |" in text
    assert text.endswith("b / y:\n```\nexit 1\nboom\n```")


class _Recorded:
    """A runner whose commands 'print' one snapshot record of the given ratio."""

    gpus = 0

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def torchrun(self, nproc: int, script: str, *args: str) -> list[str]:
        return [script, *args]

    def run(self, label: str, cmd: list[str], timeout: float) -> tuple[list[dict[str, Any]], str]:
        record: dict[str, Any] = {"ratio": self.ratio, "with_s": 0.14, "step_s": 0.13}
        record |= {"ratios": [self.ratio], "shared_memory_mib_per_rank": 29.5}
        record |= {"copy_s": 0.002, "wait_s": 0.0}
        return [record], ""


@pytest.mark.parametrize(("judged", "ratio", "status"), [(True, 1.08, "miss"), (True, 1.04, "pass"),
                                                          (None, 1.08, "pass")])  # fmt: skip
def test_the_host_snapshot_chunk_is_judged_and_the_smoke_run_is_not(
    judged: bool | None, ratio: float, status: str
) -> None:
    from scripts.gpu_snapshot_chunk import memory_snapshots

    chunk = memory_snapshots("cpu", "demo", steps=8, rounds=8, judged=judged)
    (row,) = chunk(_Recorded(ratio))  # type: ignore[arg-type]
    assert row.status == status, row
    assert ("this host's cores" in row.check) == bool(judged), row.check


def test_a_gpu_scale_row_says_whether_the_allocator_retried() -> None:
    import time

    from scripts.gpu_chunks import _scale_row
    from scripts.gpu_runner import Runner

    runner = Runner(env={}, deadline=time.monotonic() + 60, gpus=1, device="cuda")
    found = {
        impl: {"step_s": 0.24, "peak_alloc_bytes": 8 * 2**30, "num_alloc_retries": retries}
        for impl, retries in (("shardkit", 0), ("torch", 3))
    }
    row = _scale_row("7.5b", 8, found, runner)
    assert "; fits an 80 GB H100; allocator retries 0 vs 3" in row.figures, row.figures
    # A ratio shown as 1.00x can hide a peak above torch's: the bytes are printed too.
    found["shardkit"]["peak_alloc_bytes"] += 2_000_000
    row = _scale_row("7.5b", 8, found, runner)
    assert row.status == "miss" and "allocated peak +2.0 MB" in row.figures, row


def test_on_cuda_the_planner_budget_is_a_share_of_the_reserved_peak_it_budgets() -> None:
    # The GPU run of 2026-11-30 found no plan: the share was taken of the default's live peak
    # while the search budgets the allocator's reserved peak on CUDA (0.49 of it at 217M).
    from benchmarks.cuda_planner_run import predict

    from shardkit.tools.plan.timing.hardware import H100

    default = predict("fake-tiny", 8, 0.6, H100, False, "cuda")[0]
    assert default["budget_bytes"] == int(0.6 * default["predicted_reserved_bytes"]), default


def test_the_217m_chosen_plan_fits_its_share_of_the_reserved_peak() -> None:
    # The GPU chunk's point itself (slow list: the search takes about 10 s of CPU): a plan
    # under 0.6 of the default's reserved peak exists, found without a GPU.
    from benchmarks.cuda_planner_run import predict

    from shardkit.tools.plan.timing.hardware import H200

    default, chosen = predict("217m", 8, 0.6, H200, False, "cuda")
    assert chosen["predicted_reserved_bytes"] <= chosen["budget_bytes"], chosen
    assert chosen["predicted_reserved_bytes"] < default["predicted_reserved_bytes"], chosen


def _export_record(peak_mib: float, trl_mib: float) -> dict[str, Any]:
    return {"impl": "shardkit", "syncs": 3, "mismatches": [], "errors": [], "identical": True,
            "exports": {"colocated": 3}, "delta_share_max": 0.05, "world": 1,
            "full_handed_bytes": 300 * 2**20, "export_s": 0.025, "trl_s": 0.030,
            "export_vs_trl": 0.83, "export_peak_mib": peak_mib, "trl_peak_mib": trl_mib,
            "step_peak_mib": 1100.0, "step_s": 0.06}  # fmt: skip


@pytest.mark.parametrize(("peak", "trl", "status"), [(348.0, 381.0, "pass"), (440.0, 500.0, "miss"),
                                                      (350.0, 340.0, "miss")])  # fmt: skip
def test_the_export_peak_is_judged_beside_the_staged_copy_and_trls(
    peak: float, trl: float, status: str
) -> None:
    # All or nothing, rank 0's receiver holds what a full export hands it until the commit:
    # the bound is that copy (300 MiB here) and two 64 MiB buckets, and trl's pattern's peak.
    from scripts.gpu_export_chunk import export_rows

    rows = export_rows([_export_record(peak, trl)], "", device="cuda", size="150m", world=1)
    assert rows[1].status == status, rows[1]
    assert "bound 428: the receiver's staged copy 300 and two buckets" in rows[1].figures


# Prints a record, or first kills itself with SIGSEGV where the marker file is not there yet
# ("always": every time), as a rare crash in torch's gloo threads kills a rank.
_CRASHING = """
import json, os, signal, sys
marker, always = sys.argv[1], sys.argv[2] == "always"
if always or not os.path.exists(marker):
    open(marker, "w").close()
    print(json.dumps({"attempt": "first"}), flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
print(json.dumps({"attempt": "second"}))
"""


@pytest.mark.parametrize("always", [False, True])
def test_a_command_killed_by_a_crash_signal_runs_once_more(tmp_path: Path, always: bool) -> None:
    runner = Runner(env=dict(os.environ), deadline=time.monotonic() + 120, gpus=0, device="cpu")
    marker = str(tmp_path / "crashed-once")
    cmd = [sys.executable, "-c", _CRASHING, marker, "always" if always else "once"]
    records, error = runner.run("crashing", cmd, timeout=60)
    assert len(runner.crashes_retried) == 1 and "exit -11" in runner.crashes_retried[0]
    if always:  # the second crash is the command's error; the first run's record is dropped
        assert error.startswith("exit -11") and records == [{"attempt": "first"}]
    else:
        assert error == "" and records == [{"attempt": "second"}]
    assert runner.records["crashing"] == records


def test_a_command_that_fails_without_a_crash_runs_once(tmp_path: Path) -> None:
    runner = Runner(env=dict(os.environ), deadline=time.monotonic() + 120, gpus=0, device="cpu")
    records, error = runner.run("failing", [sys.executable, "-c", "raise SystemExit(3)"], 60)
    assert error.startswith("exit 3") and records == [] and runner.crashes_retried == []


def _planner_record(plan: str, ratio: float, fits: bool) -> dict[str, Any]:
    # On CUDA: ``ratio`` is the measured allocated bytes over the allocator model's.
    return {"plan": plan, "description": "per block", "predicted_peak_bytes": 2**30,
            "measured_peak_bytes": int(ratio * 2**30), "peak_ratio": ratio,
            "predicted_allocated_bytes": 2**30, "peak_alloc_bytes": int(ratio * 2**30),
            "allocated_ratio": ratio, "predicted_reserved_bytes": 2**31,
            "peak_reserved_bytes": 2**31, "reserved_ratio": 1.0,
            "live_peak_bytes": 2**30, "budget_bytes": 2**31, "fits_budget": fits,
            "predicted_step_s": 0.2, "step_s": 0.25, "hardware": "H100"}  # fmt: skip


@pytest.mark.parametrize(
    ("ratio", "fits", "statuses"),
    [(1.08, True, ["pass", "pass"]), (1.12, True, ["fail", "fail"]),
     (0.95, False, ["pass", "fail"])],
)  # fmt: skip
def test_the_planner_rows_judge_the_peak_and_the_budget(
    ratio: float, fits: bool, statuses: list[str]
) -> None:
    from scripts.gpu_planner_chunk import planner_rows

    records = [_planner_record(p, ratio, fits) for p in ("default", "chosen")]
    rows = planner_rows(records, "", device="cuda", size="217m", world=8, share=0.6)
    assert [r.status for r in rows] == statuses, rows
    assert rows[0].check == "planner: 217M default plan, fake group W=8 (cuda)"
    figures = rows[0].figures
    assert "allocated predicted 1024.0 MiB" in figures and "reserved predicted 2048.0" in figures
    assert "live predicted 1024.0 MiB, measured 1024.0 MiB" in figures, figures
    (missing,) = planner_rows([], "exit 1", device="cuda", size="217m", world=8, share=0.6)[1:]
    assert missing.status == "error" and missing.detail == "exit 1"
