"""Weights to an inference engine at W=2: shardkit's export beside trl's per-parameter pattern.

Per sync, for the 5M and ~150M Qwen2-style models (fp32 masters, bf16 receiver), in each
transport (in rank 0's process, another process through shared memory, another process over
a group of its own): the time (the export's own part and the receiver's load), the bytes on
the wire against the model's bf16 bytes, a delta export's bytes after an AdamW step at
lr 1e-6, and each trainer rank's peak RSS against its training step's
(benchmarks/export_run.py measures; SHARDKIT_BENCH_EXPORT_SIZES picks sizes). And a delta's
trainer-side time against a full export's, paired round by round, at lr 1e-6, 1e-5 and 1e-3
(benchmarks/export_delta_run.py). Into vLLM's CPU build (engines colocated and in their own
process, trl's pattern in the same run): benchmarks/bench_export_vllm.py, under .venv-vllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZES = os.environ.get("SHARDKIT_BENCH_EXPORT_SIZES", "5m,150m").split(",")


def _run(size: str, transport: str, rounds: int) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "benchmarks" / "export_run.py"), size, transport, str(rounds)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=3600)
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    result: dict[str, Any] = json.loads(line)
    return result


@pytest.mark.parametrize("transport", ["colocated", "shm", "group"])
@pytest.mark.parametrize("size", SIZES)
def test_export_against_trl_pattern(benchmark: Any, size: str, transport: str) -> None:
    results: dict[str, Any] = {}

    def measure() -> None:
        results.update(_run(size, transport, rounds=5 if size == "5m" else 3))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    r = results
    full_wire = r["model_bytes_bf16"] // 2  # W=2: the minimum, the other rank's half
    step_peak = max(row[0] for row in r["peaks_mib"])
    export_peak = max(row[1] for row in r["peaks_mib"])
    bucket_mib = r["bucket_bytes"] / 2**20
    # VmHWM during the sync (a delta's kept part included): trl's pattern, full, delta
    wholes = [[row[5], row[4], row[6]] for row in r["peaks_mib"]]
    benchmark.extra_info.update(
        r,
        export_part_ratio=r["ours_export_s"] / r["trl_export_s"],
        sync_ratio=r["ours_s"] / r["trl_s"],
        wire_over_minimum=r["wire_ours"] / full_wire,
        delta_over_full=r["wire_delta"] / r["wire_ours"],
    )
    sys.stdout.write(
        f"\n{size} {transport}: sync {r['ours_s']:.3f} s vs trl {r['trl_s']:.3f} s; export part "
        f"{r['ours_export_s']:.3f} vs {r['trl_export_s']:.3f} s "
        f"({r['ours_export_s'] / r['trl_export_s']:.2f}x); load {r['ours_load_s']:.3f} vs "
        f"{r['trl_load_s']:.3f} s; wire {r['wire_ours'] / 2**20:.1f} MiB (minimum "
        f"{full_wire / 2**20:.1f}) vs trl {r['wire_trl'] / 2**20:.1f}; delta "
        f"{100 * r['wire_delta'] / r['wire_ours']:.2f}% of a full export; peak RSS above the "
        f"start: export {export_peak:.0f} MiB, step {step_peak:.0f} MiB, bucket {bucket_mib:.0f}; "
        f"the whole per rank (trl / full / delta, MiB): {wholes}\n"
    )
    assert r["wire_ours"] == full_wire  # the minimum bytes: each rank's half once, in bf16


@pytest.mark.parametrize("paced", [False, True], ids=["delta", "paced"])
@pytest.mark.parametrize("lr", ["1e-6", "1e-5", "1e-3"])
@pytest.mark.parametrize("size", SIZES)
def test_delta_against_full(benchmark: Any, size: str, lr: str, paced: bool) -> None:
    """A delta sync's trainer-side time against a full one's, paired round by round
    (benchmarks/export_delta_run.py): at lr 1e-6 a few percent of the bf16 elements change; at
    1e-5 and 1e-3 more than 1/8 do, and the delta's buckets go plain. ``paced``: the delta
    exporter with ``plain_when_faster``, 24 rounds (its comparisons are a few of them). Times
    only: glibc's default allocator (the low mmap threshold the RSS runs use would charge each
    chunk's temporaries a page fault)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "benchmarks" / "export_delta_run.py"), size, lr]
    cmd += ["24", "paced"] if paced else ["5"]
    results: dict[str, Any] = {}

    def measure() -> None:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, check=True, timeout=3600
        )
        results.update(json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{"))))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    rows = results["rounds"]
    benchmark.extra_info.update(results)
    ratios = ", ".join(f"{x:.2f}" for x in sorted(row["ratio"] for row in rows))
    sys.stdout.write(
        f"\n{size} lr {lr}: trainer side, full {results['full_s_median']:.3f} s, delta "
        f"{results['delta_s_median']:.3f} s; delta/full per round {ratios} "
        f"(median {results['ratio_median']:.2f}); changed {100 * rows[-1]['changed']:.2f}%; "
        f"bytes {100 * rows[-1]['delta_bytes'] / rows[-1]['full_bytes']:.2f}% of full; plain "
        f"buckets {rows[-1]['plain_buckets']}/{rows[-1]['buckets']}; rounds paced "
        f"{sum(1 for row in rows if row['paced_buckets'])}/{len(rows)}; all rounds' delta "
        f"{sum(r['delta_s'] for r in rows) / sum(r['full_s'] for r in rows):.2f}x the full's\n"
    )
    assert all(row["delta_bytes"] <= row["full_bytes"] for row in rows)
