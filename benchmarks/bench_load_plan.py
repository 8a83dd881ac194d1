"""A load's planning at thousands of ranks, from the layout record (issue 85).

``load_plan_run.py`` does the work: ``save_plan_run``'s Llama 8B and 70B with AdamW under FSDP,
HSDP (8 ranks a replica) and FSDP1's ShardedTensors, saved at W = 1,024, 4,096, 8,192 and
16,384 and loaded at W and at W/2 (DCP's load planning of the same checkpoints:
``bench_dcp_load_plan.py``).
Issue 85's targets: the record at most 5 MiB and written in under 1 s (``.metadata``: 1.1 GiB
and 121 s for 70B under FSDP at 8,192), a rank's load planning under 1 s at 8,192 and flat in
W, with no plan exchanged (the manager's load agrees on its checks by one all-reduce of 24
bytes). The bounds are on CPU time: on this shared machine wall-clock grows with the others'
load.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import load_plan_run
from benchmarks.save_plan_run import LAYOUTS

WORLDS = (1024, 4096, 8192, 16384)


def test_a_load_plan_at_thousands_of_ranks(benchmark: Any) -> None:
    records: list[dict[str, Any]] = []

    def measure() -> None:
        with tempfile.TemporaryDirectory() as folder:
            for size in ("8b", "70b"):
                for layout in LAYOUTS:
                    for world in WORLDS:
                        records.append(load_plan_run.point(size, world, layout, Path(folder)))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    sys.stdout.write("\n")
    for r in records:
        name = f"shardkit {r['size']} {r['layout']} W={r['world']}"
        figures = (
            f"record {r['record_bytes'] / 2**10:.0f} KiB in {r['record_write_cpu_s'] * 1e3:.0f} "
            f"ms (.metadata: {r['metadata_entries']:,} entries); a rank's plan "
            f"{r['same_plan_cpu_s_per_rank'] * 1e3:.0f} ms at W, "
            f"{r['half_plan_cpu_s_per_rank'] * 1e3:.0f} ms at W/2 (CPU; wall "
            f"{r['same_plan_s_per_rank'] * 1e3:.0f} / {r['half_plan_s_per_rank'] * 1e3:.0f} ms)"
        )
        benchmark.extra_info[name] = figures
        sys.stdout.write(f"{name:<28} {figures}\n")
    assert all(r["planning_collectives"] == 0 and r["agreement_bytes"] == 24 for r in records)
    assert all(r["record_bytes"] <= 5 * 2**20 for r in records)
    # Generous bounds on a shared 2-core machine: the targets are 1 s; noise moves these 2x.
    assert all(r["record_write_cpu_s"] < 2.0 for r in records)
    assert all(
        max(r["same_plan_cpu_s_per_rank"], r["half_plan_cpu_s_per_rank"]) < 2.0 for r in records
    )
