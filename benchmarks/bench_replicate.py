"""``replicate`` against torch's (W=2, gloo, the 8.4M GPT): step time, losses, peak memory.

With one shard rank shardkit's full parameters are the replicated tensors themselves, where
torch's replicate copies them into unsharded parameters of their own; the step's collectives
are the same (one all-reduce of each group's gradients). See replicate_run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "benchmarks" / "replicate_run.py"), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(next(x for x in done.stdout.splitlines() if x[:1] == "{"))
    return result


def test_replicate_against_torchs(benchmark: Any) -> None:
    runs: dict[str, dict[str, Any]] = {}

    def measure() -> None:
        runs["time"] = _run("time")
        for impl in ("shardkit", "torch"):
            runs[impl] = _run("memory", impl)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info = {f"{key}_{name}": value for key, run in runs.items() for name, value in run.items()}
    benchmark.extra_info.update(info)
    timing, ours, theirs = runs["time"], runs["shardkit"], runs["torch"]
    sys.stdout.write(
        f"\nreplicate, W=2: step {timing['shardkit_ms']:.0f} ms (torch's "
        f"{timing['torch_ms']:.0f} ms), losses equal: {timing['same_losses']}; peak live "
        f"tensors {ours['peak_mib']:.1f} MiB (torch's {theirs['peak_mib']:.1f} MiB), peak RSS "
        f"{ours['rss_mib']:.0f} MiB (torch's {theirs['rss_mib']:.0f} MiB)\n"
    )
    assert timing["same_losses"]
    assert ours["peak_mib"] <= theirs["peak_mib"] * 1.01
