"""Weights into vLLM's CPU build at W=2: shardkit's export (full, delta) beside trl's pattern.

One command, under the vLLM environment (``make check-vllm`` sets it up)::

    .venv-vllm/bin/python benchmarks/bench_export_vllm.py [SIZES] [ROUNDS] [BUCKETS_MIB]
        [MODES] [PLACEMENTS] [RATES]

``SIZES``: ``5m``, ``150m`` or ``5m,150m`` (the default); ``ROUNDS``: syncs measured per
mode (default 3, after a warm-up sync); ``BUCKETS_MIB``: the exports' ``bucket_bytes`` to
run, in MiB (default ``64,512``: the default, and the default before 2026-11-30; trl's
pattern has no buckets and runs once). Every combination of placement (``colocated``: an
engine in each trainer process; ``process``: rank 0's engine core in a process of its own),
mode (``trl``, ``full``, ``delta``, ``streamed``: full exports with no mirror and no
versions, ``files``: deltas streamed, the mirror in files, ``versioned``: deltas all or
nothing, the mirror and the staged export in files), bucket size and
learning rate (1e-6, 1e-5) runs in fresh processes (``benchmarks/export_vllm_run.py``; comma
lists in the last three arguments run part of the grid), so each mode's peak RSS is its own.
Prints one table row per combination (medians over the rounds; peak RSS per trainer rank, the
highest of the rounds, and apart that of the first sync, a warm-up not counted in the rest) and
writes every round to ``benchmarks/.results/export_vllm.json``. Here, at load 5-45 on 2 cores,
5M took 36 minutes (most of it starting engines); 150M should take about an hour and a half.
A script, not a pytest benchmark: the default environment has no vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = ("colocated", "process")
MODES = ("trl", "full", "delta", "streamed", "files", "versioned")
RATES = ("1e-6", "1e-5")


def run_mode(
    size: str, placement: str, mode: str, lr: str, rounds: int, folder: Path, bucket_mib: int
) -> Any:
    """One combination in fresh processes (torchrun, W=2); its JSON line."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "benchmarks" / "export_vllm_run.py"), size, placement, mode, lr]
    cmd += [str(rounds), str(folder), str(bucket_mib)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def row(result: dict[str, Any]) -> str:
    """One table row: medians over the rounds, peaks the highest."""
    rows = result["rows"]

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    peaks = [max(r["peak_rss_mib"][i] for r in rows) for i in range(2)]
    rises = [max(r["peak_above_start_mib"][i] for r in rows) for i in range(2)]
    first = result.get("first_sync") or {}
    firsts = first.get("peak_rss_mib", [float("nan")] * 2)
    bucket = "-" if result["mode"] == "trl" else f"{result['bucket_mib']} MiB"
    return (
        f"| {result['size']} | {result['placement']} | {result['lr']:g} | {result['mode']} | "
        f"{bucket} | "
        f"{median('sync_s'):.3f} | {median('trainer_s'):.3f} | {median('engine_s'):.3f} | "
        f"{median('bytes') / 2**20:.2f} MiB | r0 {peaks[0]:.0f} ({rises[0]:.0f}), "
        f"r1 {peaks[1]:.0f} ({rises[1]:.0f}) MiB | r0 {firsts[0]:.0f}, r1 {firsts[1]:.0f} MiB |"
    )


def main(argv: list[str]) -> None:
    sizes = (argv[0] if argv else "5m,150m").split(",")
    rounds = int(argv[1]) if len(argv) > 1 else 3
    buckets = [int(b) for b in (argv[2] if len(argv) > 2 else "64,512").split(",")]
    # Part of the grid: comma lists of modes, placements, rates (default: all).
    modes = argv[3].split(",") if len(argv) > 3 else list(MODES)
    placements = argv[4].split(",") if len(argv) > 4 else list(PLACEMENTS)
    rates = argv[5].split(",") if len(argv) > 5 else list(RATES)
    print(os.getloadavg(), flush=True)
    head = (
        "| model | engine | lr | mode | bucket_bytes | sync | trainer side | engine load | "
        "bytes | peak RSS (above the sync's start) | the first sync's peak RSS |"
    )
    print(head + "\n" + "|---" * 11 + "|", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in sizes:
            folder = Path(scratch) / size  # the engines' initial weights, written once
            for placement in placements:
                for lr in rates:
                    for mode in modes:
                        # trl's pattern has no buckets: once per placement and rate
                        for bucket in buckets[:1] if mode == "trl" else buckets:
                            result = run_mode(size, placement, mode, lr, rounds, folder, bucket)
                            result["load_average"] = os.getloadavg()
                            results.append(result)
                            print(row(result), flush=True)
    out = ROOT / "benchmarks" / ".results" / "export_vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"rounds in {out}; load average now {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
