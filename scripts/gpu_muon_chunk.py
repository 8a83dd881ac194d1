"""``make check-gpu``'s Muon chunks: issue 83's whole-matrix Muon on a GPU.

Its own module: scripts/gpu_chunks.py, which registers it, is near the house's 450-line limit.
``benchmarks/cuda_muon_run.py`` runs each part in a process of its own:

- bit-identity at one GPU (NCCL, deterministic algorithms): shardkit's Muon on ``fully_shard``
  against ``torch.optim.Muon`` on the unsharded model, the 217M GPT in fp32, 3 steps;
- the same with Muon's foreach elementwise path opened on the device (shut on CUDA until this
  says it keeps every bit: five operators a step instead of five a matrix);
- whether batched Newton-Schulz keeps each matrix's bits on this device (on the CPU it does
  not, so matrices go one at a time there), and what batching would save;
- the step, the optimizer step over AdamW's against the Newton-Schulz floor (issue 83: at most
  1.1) and the peak against AdamW's, one configuration per process: at W=1 in fp32 beside
  ``torch.optim.Muon`` on the unsharded model (a single GPU's Muon), and on the fake group at
  W=8 (217M) and W=64 (7.5B), bf16 with activation checkpointing, as the scale points.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from scripts.gpu_runner import Row, Runner

__all__ = ["OVER_FLOOR_TARGET", "muon", "point_row"]

SCRIPT = "benchmarks/cuda_muon_run.py"
OVER_FLOOR_TARGET = 1.1
"""Issue 83: Muon's optimizer step costs AdamW's plus its Newton-Schulz, at most 10% more."""


def muon(
    device: str, size: str, points: tuple[tuple[str, int], ...], *, checks: bool = True,
    steps: int = 10, rounds: int = 6,
) -> Callable[[Runner], list[Row]]:  # fmt: skip
    """The chunk: ``checks`` (bit-identity, batching) with ``size``, then each (size, W) point."""

    def run(runner: Runner) -> list[Row]:
        rows = _checks(runner, device, size) if checks else []
        for point_size, world in points:
            configs = ("adamw", "muon", "plain-muon") if world == 1 else ("adamw", "muon")
            found: dict[str, dict[str, Any]] = {}
            errors = []
            for config, foreach in [*((c, False) for c in configs), ("muon", True)]:
                cmd = [sys.executable, SCRIPT, "point", config, point_size, str(world)]
                cmd += ["--device", device, "--steps", str(steps), "--rounds", str(rounds)]
                records, error = runner.run("muon", cmd + ["--foreach"] * foreach, timeout=300)
                if records:
                    found[config + "-foreach" * foreach] = records[0]
                errors.append(error)
            rows.append(point_row(found, errors, size=point_size, world=world, device=device))
        return rows

    return run


def _checks(runner: Runner, device: str, size: str) -> list[Row]:
    where = f"{size} fp32, W=1 ({'NCCL' if device == 'cuda' else 'gloo'}, {device})"
    rows = []
    for foreach in (False, True):
        how = " (foreach elementwise opened)" if foreach else ""
        label = f"Muon{how} on fully_shard vs torch.optim.Muon unsharded, {where}, deterministic"
        cmd = runner.torchrun(1, SCRIPT, "parity", "--device", device, "--size", size)
        records, error = runner.run("muon", cmd + ["--foreach"] * foreach, timeout=300)
        if not records:
            rows.append(Row(chunk="", check=label, status="error", detail=error))
            continue
        r = records[0]
        same = r["identical"]
        figures = (
            f"{r['steps']} steps, {r['matrices']} matrices by Muon, {r['params']} parameters: "
            + ("bit-identical" if same else f"DIFFERENT (max {r['max_param_diff']:.3g})")
        )
        detail = "" if same else f"parameters that differ: {r['different']}; {r['losses']}"
        if foreach:  # a probe of whether the device may open the path: reported, not judged
            figures += "; foreach may open here" if same else "; foreach stays shut here"
            rows.append(Row(chunk="", check=label, status="pass", figures=figures, detail=detail))
        else:
            rows.append(Row(chunk="", check=label, status="pass" if same else "fail",
                            figures=figures, detail=detail))  # fmt: skip
    label = f"Newton-Schulz batched vs one matrix at a time, {size}'s shapes ({device})"
    cmd = [sys.executable, SCRIPT, "batched", "--device", device, "--size", size]
    records, error = runner.run("muon", cmd, timeout=180)
    if not records:
        return [*rows, Row(chunk="", check=label, status="error", detail=error)]
    r = records[0]
    kept = ", ".join(
        f"{shape} x{s['matrices']}: " + ("same bits" if s["identical"] else f"{s['max_diff']:.3g}")
        for shape, s in r["shapes"].items()
    )
    figures = (
        f"{kept}; one at a time {r['one_by_one_s'] * 1e3:.2f} ms, batched "
        f"{r['batched_s'] * 1e3:.2f} ms"
    )
    # Reported, not judged: whether the device may batch is what it measures.
    return [*rows, Row(chunk="", check=label, status="pass", figures=figures)]


def point_row(
    found: dict[str, dict[str, Any]], errors: list[str], *, size: str, world: int, device: str
) -> Row:
    """One point's row: Muon's step and peak against AdamW's (and a single GPU's Muon at W=1),
    its optimizer step over AdamW's against the floor."""
    how = "fp32" if world == 1 else "bf16 + AC, fake group"
    label = f"Muon step, {size} W={world} ({how}, {device}): over AdamW vs the floor, peak"
    needed = ("adamw", "muon", "plain-muon") if world == 1 else ("adamw", "muon")
    if any(c not in found for c in needed):
        return Row(chunk="", check=label, status="error", detail="\n".join(e for e in errors if e))
    ours, adamw = found["muon"], found["adamw"]
    cells = [
        f"step {ours['step_s'] * 1e3:.1f} ms vs AdamW's {adamw['step_s'] * 1e3:.1f} ms"
        f" ({ours['step_s'] / adamw['step_s']:.3f}x)",
        f"optimizer step {ours['optimizer_muon_s'] * 1e3:.2f} ms vs AdamW's "
        f"{ours['optimizer_adamw_s'] * 1e3:.2f} ms, floor {ours['floor_s'] * 1e3:.2f} ms: "
        f"over_floor {ours['over_floor']:.2f}",
    ]
    met = ours["over_floor"] <= OVER_FLOOR_TARGET
    if world == 1:
        plain = found["plain-muon"]
        cells.append(
            f"torch.optim.Muon unsharded: step {plain['step_s'] * 1e3:.1f} ms "
            f"({ours['step_s'] / plain['step_s']:.3f}x), over_floor {plain['over_floor']:.2f}"
        )
    if "peak_alloc_bytes" in ours:
        peak = ours["peak_alloc_bytes"] / adamw["peak_alloc_bytes"]
        asked = ours["peak_requested_bytes"] - adamw["peak_requested_bytes"]
        cells.append(
            f"peak {ours['peak_alloc_bytes'] / 2**30:.2f} vs AdamW's "
            f"{adamw['peak_alloc_bytes'] / 2**30:.2f} GiB ({peak:.3f}x; requested "
            f"{asked / 1e6:+.1f} MB)"
        )
        met = met and peak <= 1.0
    opened = found.get("muon-foreach")
    if opened is not None:
        cells.append(
            f"with foreach opened: optimizer step {opened['optimizer_muon_s'] * 1e3:.2f} ms, "
            f"over_floor {opened['over_floor']:.2f}"
        )
    stats = ours.get("muon_stats")
    if stats:
        cells.append(
            f"this rank: {stats['updates']} whole matrices, {stats['collectives']} collectives"
        )
    if device != "cuda":  # a CPU run checks the code path; its figures say little
        return Row(chunk="", check=label, status="pass", figures="ran: " + "; ".join(cells))
    return Row(chunk="", check=label, status="pass" if met else "miss", figures="; ".join(cells))
