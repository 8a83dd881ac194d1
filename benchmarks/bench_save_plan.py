"""A save's planning at thousands of ranks: shardkit's local plan beside DCP's (issue 75).

``save_plan_run.py`` does the work: Llama 8B and 70B layouts with AdamW's state, FSDP, HSDP
(8 ranks a replica) and FSDP1's ShardedTensors (SHARDED_STATE_DICT without a device mesh),
shardkit's per-rank planning at W = 1,024, 4,096 and 8,192, and torch's
``DefaultSavePlanner.create_global_plan`` on the W ranks' local plans at W = 64 and 256 (rank
0's work at every DCP save; it grows faster than W). Issue 75's targets: what a rank's
training thread waits for at a save under 1 s at W = 8,192 and flat in W, no planning
collective, and the metadata equal in content to torch's where both run.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import save_plan_run

WORLDS = (1024, 4096, 8192)
TORCH_WORLDS = (64, 256)


def _mib(spread: dict[str, float]) -> str:
    return "/".join(f"{spread[k] / 2**20:.1f}" for k in ("min", "median", "max")) + " MiB"


def test_a_save_plan_at_thousands_of_ranks(benchmark: Any) -> None:
    records: list[dict[str, Any]] = []

    def measure() -> None:
        for size in ("8b", "70b"):
            for layout in save_plan_run.LAYOUTS:
                for world in TORCH_WORLDS:
                    records.append(save_plan_run.torch_point(size, world, layout, compare=True))
                    records.append(save_plan_run.shardkit_point(size, world, layout))
                for world in WORLDS:
                    records.append(save_plan_run.shardkit_point(size, world, layout))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    sys.stdout.write("\n")
    for r in records:
        name = f"{r['engine']} {r['size']} {r['layout']} W={r['world']}"
        if r["engine"] == "torch":
            figures = (
                f"rank 0's global plan {r['rank0_global_plan_s']:.2f} s, plans gathered "
                f"{r['plans_gathered_bytes'] / 2**20:.1f} MiB, metadata equal: "
                f"{r['metadata_equal']}"
            )
        else:
            figures = (
                f"wait {r['wait_s'] * 1e3:.1f} ms ({r['wait_cpu_s'] * 1e3:.1f} ms CPU; first "
                "save of the layout "
                f"{(r['digest_s'] + r['first_plan_s']) * 1e3:.1f} ms); rank 0: metadata "
                f"{r['rank0_metadata_s'] * 1e3:.1f} ms once, check {r['rank0_check_s'] * 1e3:.1f} "
                f"ms, {r['metadata_chunks']:,} chunks; bytes a rank min/median/max "
                f"{_mib(r['bytes_per_rank'])} (by turns: {_mib(r['bytes_per_rank_by_turns'])})"
            )
        benchmark.extra_info[name] = figures
        sys.stdout.write(f"{name:<28} {figures}\n")
    assert all(r["planning_collectives"] == 0 for r in records if r["engine"] == "shardkit")
    # FSDP1's ShardedTensors too: their shards enter the digest as a hash of their offsets and
    # sizes (``sharded_tensor_chunks.Shards``; as text they took 7 s at 8B and W = 8,192). A
    # real rank also reads each ShardedTensor's metadata (a walk over its W shards), which
    # these simulated ranks do not: see docs/performance.md.
    ours = [r for r in records if r["engine"] == "shardkit"]
    assert all(r["wait_s"] < 1.0 for r in ours), [r["wait_s"] for r in ours]
    # Flat in W, by the CPU time of the rank's work: its wall clock of a few milliseconds is
    # the machine's load on a shared one (0.68 s against 8.8 ms failed this check at load 7).
    at_scale = [r["wait_cpu_s"] for r in ours if r["world"] in WORLDS]
    assert max(at_scale) < 3 * min(at_scale) + 0.05, at_scale
    assert all(r["metadata_equal"] for r in records if r["engine"] == "torch")
    # Issue 85: under HSDP the busiest rank writes at most 1.25 times the mean (the replicas
    # share the writing by bytes). Under FSDP and FSDP1 each chunk has one holder, which
    # writes its own shard: the spread is torch.chunk's (at 8B and W = 8,192 some ranks hold
    # none of the smaller tensors: max 1.7x the mean), not the save's to choose.
    for r in (r for r in ours if r["layout"] == "hsdp"):
        spread = r["bytes_per_rank"]
        assert spread["max"] <= 1.25 * spread["mean"], (r["size"], r["layout"], r["world"], spread)
