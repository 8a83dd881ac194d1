"""Operators of one training step on torch's fake process group, shardkit beside torch's.

The table ``make bench`` prints: for each case (plain fp32, bf16, HSDP, TP; even sizes and
sizes that pad every shard) and world size, every operator dispatched and those that launch
a kernel on a GPU, torch's ``fully_shard`` against shardkit as it packs on CPU and as it
packs on an accelerator (one ``_chunk_cat`` per group). See op_count_workload.py; the test
``tests/core/engine/test_op_counts.py`` holds these counts.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.op_count_workload import CASES, StepOps, count_step

WORLDS = (8, 64, 256)


def _row(case: str, uneven: bool, world: int) -> tuple[str, dict[str, StepOps]]:
    label = f"{case}{' uneven' if uneven else ''} W={world}"
    runs = {
        "torch": count_step("torch", case, world, uneven=uneven),
        "shardkit cpu": count_step("shardkit", case, world, uneven=uneven),
        "shardkit gpu": count_step("shardkit", case, world, uneven=uneven, fused_packing=True),
    }
    return label, runs


def test_step_operator_counts(benchmark: Any) -> None:
    table: list[tuple[str, dict[str, StepOps]]] = []

    def measure() -> None:
        table.clear()
        for case in CASES:
            for uneven in (False, True):
                for world in WORLDS:
                    table.append(_row(case, uneven, world))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    out = ["", "operators of one step (all / kernel launches), fake process group:"]
    out.append(
        f"{'case':<22}{'torch':>14}{'shardkit cpu':>16}{'shardkit gpu':>16}{'gpu/torch':>11}"
    )
    for label, runs in table:
        cells = [f"{r.total:>6} / {r.launches:<5}" for r in runs.values()]
        ratio = runs["shardkit gpu"].launches / runs["torch"].launches
        out.append(f"{label:<22}{cells[0]:>14}{cells[1]:>16}{cells[2]:>16}{ratio:>11.2f}")
        for name, run in runs.items():
            key = f"{label.replace(' ', '_')}_{name.replace(' ', '_')}"
            benchmark.extra_info[f"{key}_total"] = run.total
            benchmark.extra_info[f"{key}_launches"] = run.launches
    sys.stdout.write("\n".join(out) + "\n")
