"""Replicate-only ``dp_mesh_dims`` (dp 2 x tp 2): shardkit's parameters exist once per rank.

With one shard rank shardkit's unsharded parameters view the shards, where torch's
``fully_shard`` gathers a second copy of them (kept from forward to each layer's backward).
Peak live tensor memory per rank (MemoryTracker) for both, with small activations (the peak
is the end of backward, gradients and optimizer state beside the parameters) and larger ones
(the peak is where forward turns into backward). See dp_mesh_dims_memory_run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _run(impl: str, rows: int) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(ROOT / "benchmarks" / "dp_mesh_dims_memory_run.py"), impl, str(rows)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, float] = json.loads(next(x for x in done.stdout.splitlines() if x[:1] == "{"))
    return result


def test_replicate_only_memory(benchmark: Any) -> None:
    runs: dict[str, dict[str, float]] = {}

    def measure() -> None:
        for rows in (8, 512):
            for impl in ("shardkit", "torch"):
                runs[f"{impl}_{rows}"] = _run(impl, rows)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info = {f"{key}_{name}": value for key, run in runs.items() for name, value in run.items()}
    benchmark.extra_info.update(info)
    for rows in (8, 512):
        ours, theirs = runs[f"shardkit_{rows}"], runs[f"torch_{rows}"]
        sys.stdout.write(
            f"\nreplicate-only, {rows} rows per dp rank: peak live tensors shardkit "
            f"{ours['peak_mib']:.1f} MiB, torch {theirs['peak_mib']:.1f} MiB; peak RSS "
            f"{ours['rss_mib']:.0f} vs {theirs['rss_mib']:.0f} MiB\n"
        )
        assert ours["peak_mib"] <= theirs["peak_mib"] * 1.01  # never a second copy
