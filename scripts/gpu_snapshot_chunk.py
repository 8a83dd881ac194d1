"""``make check-gpu``'s memory-snapshots chunk: issue 40's step-time limit on a GPU node.

Its own module: scripts/gpu_chunks.py, which runs it, is near the house's 450-line limit.
``benchmarks/cuda_memory_snapshots.py`` trains benchmarks/gpt.py's GPT with and without a
memory snapshot every step, alternating blocks, every GPU a "node" of its own (so at W >= 2
each snapshot is also exchanged with a peer); the row passes where the step with snapshots is
at most ``SNAPSHOT_TARGET`` of the step without. The CPU smoke run (two gloo ranks, a tiny
model) checks that the run and its record work; its ratio, on two busy cores, is not judged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scripts.gpu_runner import Row, Runner

__all__ = ["SNAPSHOT_TARGET", "memory_snapshots"]

SNAPSHOT_TARGET = 1.05  # issue 40: a snapshot every step costs at most 5% of the step


def memory_snapshots(
    device: str,
    size: str,
    steps: int,
    rounds: int,
    chunk_mib: tuple[int, ...] = (0,),
    judged: bool | None = None,
    gradient_log: bool = False,
) -> Callable[[Runner], list[Row]]:
    """The chunk: every GPU (two gloo ranks with ``device="cpu"``), ``rounds`` paired blocks.

    ``chunk_mib``: one run for each size of the staged copy's chunks (0: the default), so a
    GPU session compares them in one go. ``judged``: whether a ratio above ``SNAPSHOT_TARGET``
    is a miss (default: on CUDA only; the CPU smoke run's two busy cores are not judged, the
    GPU machine's host, whose cores mostly idle, is). ``gradient_log``: every 4th snapshot
    replicated whole and the gradient log between (``optimizer=``), instead of each whole.
    """
    judged = device == "cuda" if judged is None else judged

    def run(runner: Runner) -> list[Row]:
        return [_one(runner, mib) for mib in chunk_mib]

    def _one(runner: Runner, mib: int) -> Row:
        nproc = max(1, runner.gpus) if device == "cuda" else 2
        args = ["--device", device, "--size", size, "--steps", str(steps), "--rounds", str(rounds)]
        args += ["--chunk-mib", str(mib)] + (["--gradient-log"] if gradient_log else [])
        cmd = runner.torchrun(nproc, "benchmarks/cuda_memory_snapshots.py", *args)
        records, error = runner.run("memory-snapshots", cmd, timeout=420)
        where = device if device == "cuda" or not judged else "cpu, this host's cores"
        label = f"memory snapshots every step, {size} W={nproc} ({where}): step with / without"
        label += f", {mib} MiB chunks" if mib else ""
        label += ", every 4th replicated whole, the gradient log between" if gradient_log else ""
        if error or not records:
            return Row(chunk="", check=label, status="error", detail=error)
        r = records[0]
        figures = (
            f"{r['ratio']:.3f} ({r['with_s']:.4f} s vs {r['step_s']:.4f} s; rounds "
            f"{min(r['ratios']):.2f} to {max(r['ratios']):.2f}), "
            f"{r['shared_memory_mib_per_rank']:.0f} MiB of slots per rank in "
            f"{r.get('directory', '?')}; per "
            f"snapshot {r['copy_s'] * 1e3:.1f} ms on the training thread{_parts(r)}, then "
            f"{r['wait_s'] * 1e3:.1f} ms waiting for it at the next step; the snapshots' own "
            f"CPU {r.get('snapshot_cpu_s', float('nan')) * 1e3:.1f} ms a step (training thread "
            f"and their threads); staged on the device: {r.get('staged')}"
        )
        met = not judged or r["ratio"] <= SNAPSHOT_TARGET
        return Row(chunk="", check=label, status="pass" if met else "miss", figures=figures)

    return run


def _parts(record: dict[str, Any]) -> str:
    """The training thread's part piece by piece, where the benchmark measured it."""
    parts = record.get("parts")
    if not parts:
        return ""
    return (
        f" (state_dict() and walk {parts['state_dict_and_walk_s'] * 1e3:.1f} ms, check "
        f"{parts['check_s'] * 1e3:.1f}, copy {parts['copy_s'] * 1e3:.1f})"
    )
