"""DCP's load planning at thousands of ranks, by torch's own planner (issue 85).

``dcp_load_plan_run.py`` does the work: ``save_plan_run``'s Llama 8B and 70B with AdamW under
FSDP, HSDP (8 ranks a replica) and FSDP1's ShardedTensors, saved and loaded at W = 1,024 to
16,384: every rank's ``.metadata`` read (where it fits here), a rank's
``DefaultLoadPlanner.create_local_plan`` (ranks 0 and W-1), the plans' pickled bytes, and rank
0's global step (the W plans unpickled, ``create_global_plan``, pickled back) where the W
plans fit here (``ALL_PLANS_ITEMS`` read items); beyond, rank 0's CPU and memory are a fit
over the points measured (per read item), printed as a fit. The same checkpoints' planning
from the layout record: ``bench_load_plan.py``. About an hour at load average 2 to 10 on the
2-core VM (20 minutes of CPU), a few GiB of memory at its peak.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import dcp_load_plan_run
from benchmarks.save_plan_run import LAYOUTS

WORLDS = (1024, 4096, 8192, 16384)
ALL_PLANS_ITEMS = 2_500_000  # about 2.5 GiB of plans on rank 0 and 10 minutes at W = 1,024
UNPICKLE_ENTRIES = 2_500_000  # .metadata's objects: a few GiB


def test_dcps_load_plan_at_thousands_of_ranks(benchmark: Any) -> None:
    records: list[dict[str, Any]] = []

    def measure() -> None:
        for size in ("8b", "70b"):
            for layout in LAYOUTS:
                for world in WORLDS:
                    records.append(
                        dcp_load_plan_run.point(
                            size, world, layout, ALL_PLANS_ITEMS, UNPICKLE_ENTRIES
                        )
                    )

    benchmark.pedantic(measure, rounds=1, iterations=1)
    fit = dcp_load_plan_run.fit_rank0(records)
    sys.stdout.write("\n")
    for r in records:
        name = f"torch {r['size']} {r['layout']} W={r['world']}"
        read = (
            f".metadata {r['metadata_bytes'] / 2**20:.0f} MiB unpickled in "
            f"{r['unpickle_cpu_s_per_rank']:.1f} s; "
            if "metadata_bytes" in r
            else f".metadata {r['metadata_entries']:,} entries (not unpickled here); "
        )
        if "plans_items" in r:
            rank0 = (
                f"rank 0 {r['rank0_global_cpu_s']:.0f} s CPU ({r['rank0_global_s']:.0f} s wall), "
                f"{r['plans_gathered_bytes'] / 2**20:.0f} MiB gathered, "
                f"{r['rank0_plans_held_bytes'] / 2**30:.1f} GiB held"
            )
        else:
            items = r["plans_items_counted"]
            rank0 = (
                f"rank 0 not run; fit {items * fit['cpu_s_per_item']:.0f} s CPU, "
                f"~{r['plans_gathered_bytes_estimated'] / 2**20:.0f} MiB gathered, "
                f"{items * fit['bytes_per_item'] / 2**30:.1f} GiB held"
            )
        figures = (
            f"{read}local plan {r['local_plan_cpu_s_first_rank']:.2f} / "
            f"{r['local_plan_cpu_s_last_rank']:.2f} s CPU (ranks 0 / W-1), "
            f"{r['plan_items_per_rank']:,} items; {rank0}"
        )
        benchmark.extra_info[name] = figures
        sys.stdout.write(f"{name:<26} {figures}\n")
    sys.stdout.write(
        f"fit over the points rank 0 ran: {fit['cpu_s_per_item'] * 1e6:.1f} us of CPU and "
        f"{fit['bytes_per_item']:.0f} B held per read item\n"
    )
    assert all(r["planning_collectives"] == 2 for r in records)
    ran = [r for r in records if "plans_items" in r]
    assert ran, "rank 0's global step ran at no point: the fit has nothing to stand on"
    for r in ran:
        assert r["plans_items_counted"] == r["plans_items"]  # the count used beyond is exact
        # The bytes' estimate used beyond (per item, from the sampled plans) against the total.
        assert abs(r["plans_gathered_bytes_estimated"] / r["plans_gathered_bytes"] - 1) < 0.05
        assert r["plans_scattered_bytes"] == r["plans_gathered_bytes"]  # the plans come back
    # Under FSDP and FSDP1 a rank's local plan sorts and sweeps the saved chunks of each tensor
    # it holds (under FSDP1 the last ranks hold none of the tensors with fewer rows than W):
    # the slower of the two sampled ranks grows with W (2.5x to 8.8x from 1,024 to 16,384
    # measured on 2026-11-29).
    for size in ("8b", "70b"):
        for layout in ("fsdp", "fsdp1"):
            cpu = {
                r["world"]: max(r["local_plan_cpu_s_first_rank"], r["local_plan_cpu_s_last_rank"])
                for r in records
                if (r["size"], r["layout"]) == (size, layout)
            }
            assert cpu[max(WORLDS)] > 2 * cpu[min(WORLDS)], (size, layout, cpu)
