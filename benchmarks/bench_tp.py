"""FSDP x TP (dp 2 x tp 2, world size 4): shardkit against torch's fully_shard + the same TP plan.

World size 4 on this 2-core machine is oversubscribed: absolute times mean little, so only
ratios measured in the same run are quoted. Each round runs one step of each implementation,
alternating which goes first (see bench_train_step.py).

Bytes per axis: a third model with the TP plan and no FSDP sends only TP traffic; it is the
same for both implementations (both leave TP to DTensor), so each one's dp bytes are its
total minus that. The dp minimum per rank per step is (2 gathers + 1 reduction) x 4 bytes x
the TP-local parameters x (dp - 1) / dp.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import gpt, tp_workload
from harness.pool import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
MESH = (2, 2)
ROUNDS = 8
_STATE: dict[str, Any] = {}


def _setup(rank: int, world_size: int) -> int:
    _STATE.clear()
    for impl in ("torch", "shardkit", "tp_only"):
        model, opt, dp_rank = tp_workload.build(impl, MESH)
        _STATE[impl] = (model, opt, dp_rank)
        for step in range(2):  # warm-up: lazy init, allocator, the optimizer's first state
            gpt.train_step(model, opt, tp_workload.batch(step, dp_rank, MESH[0]))
    return tp_workload.dp_local_params(_STATE["tp_only"][0])


def _step(rank: int, world_size: int, impl: str, step: int) -> dict[str, float]:
    model, opt, dp_rank = _STATE[impl]
    return gpt.train_step(model, opt, tp_workload.batch(step, dp_rank, MESH[0]))


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


def _peak_rss(impl: str) -> float:
    """The largest rank's peak RSS (MiB) of ``impl`` training a few steps under torchrun."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(ROOT / "benchmarks" / "tp_memory_run.py"), impl, "4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    return max(float(json.loads(x)["peak_mib"]) for x in out.stdout.splitlines() if x[:1] == "{")


def test_tp_train_step(benchmark: Any) -> None:
    local_params = run_on_ranks(4, _setup)[0]
    records: dict[str, list[list[dict[str, float]]]] = {"torch": [], "shardkit": [], "tp_only": []}
    counter = [10]

    def one_round() -> None:
        counter[0] += 1
        order = ["torch", "shardkit"] if counter[0] % 2 else ["shardkit", "torch"]
        for impl in [*order, "tp_only"]:
            records[impl].append(run_on_ranks(4, _step, impl=impl, step=counter[0]))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    run_on_ranks(4, _teardown)
    times = {k: [max(r["seconds"] for r in ranks) for ranks in v] for k, v in records.items()}
    wire = {k: statistics.median(ranks[0]["wire_bytes"] for ranks in v) for k, v in records.items()}
    ratio = statistics.median(s / t for s, t in zip(times["shardkit"], times["torch"], strict=True))
    dp_min = 3 * 4 * local_params * (MESH[0] - 1) / MESH[0]
    info: dict[str, Any] = {
        "method": "paired",
        "subject": "shardkit",
        "ratio_vs_peer": ratio,
        "tp_wire_bytes_per_rank": wire["tp_only"],
        "dp_theoretical_min_bytes": dp_min,
    }
    for impl in ("shardkit", "torch"):
        info[f"dp_wire_over_min_{impl}"] = (wire[impl] - wire["tp_only"]) / dp_min
        info[f"median_step_s_{impl}"] = statistics.median(times[impl])
    rss = {impl: _peak_rss(impl) for impl in ("torch", "shardkit")}
    info |= {f"peak_rss_mib_{impl}": value for impl, value in rss.items()}
    info["peak_rss_ratio_vs_peer"] = rss["shardkit"] / rss["torch"]
    benchmark.extra_info.update(info)
    sys.stdout.write(
        f"\nFSDP x TP (dp {MESH[0]} x tp {MESH[1]}): step shardkit/torch {ratio:.3f}; dp bytes / "
        f"minimum: shardkit {info['dp_wire_over_min_shardkit']:.3f}, torch "
        f"{info['dp_wire_over_min_torch']:.3f}; tp bytes per rank {wire['tp_only']:.0f}; peak RSS "
        f"shardkit {rss['shardkit']:.0f} MiB, torch {rss['torch']:.0f} MiB "
        f"({info['peak_rss_ratio_vs_peer']:.3f})\n"
    )
    # Bytes are deterministic: shardkit's dp axis sends the minimum.
    assert abs(info["dp_wire_over_min_shardkit"] - 1.0) < 0.01
