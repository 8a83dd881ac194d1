"""One implementation's peak RSS per rank: run under torchrun with MALLOC_MMAP_THRESHOLD_ set.

Usage: torchrun --nproc-per-node 2 benchmarks/memory_run.py IMPL SIZE STEPS [OPTION ...]
OPTION: ``bf16`` (bf16 parameters, fp32 reduction) or ``keep`` (reshard_after_forward=False).
Prints one JSON line per rank: {"rank", "baseline_mib", "peak_mib"}. ``launch()`` runs it
from a benchmark and reads those lines back.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPeak:
    """One rank's record."""

    rank: int
    baseline_mib: float
    """RSS after the process group is up, before the model is built."""
    peak_mib: float
    """The process's peak RSS (ru_maxrss) at the end of the steps."""


def launch(
    impl: str, size: str, *, world: int, steps: int = 4, options: gpt.Options | None = None
) -> list[RankPeak]:
    """Run this script under torchrun on ``world`` ranks; each rank's record, in rank order.

    glibc's mmap threshold is pinned low (64 KiB) so that freed buffers go back to the
    system instead of being retained, which would hide the live memory's real peak.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", __file__, impl, size, str(steps)]
    options = options or gpt.Options()
    cmd += ["bf16"] if options.bf16 else []
    cmd += [] if options.reshard_after_forward else ["keep"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800)
    records = [json.loads(x) for x in out.stdout.splitlines() if x[:1] == "{"]
    peaks = [RankPeak(**r) for r in records]
    return sorted(peaks, key=lambda r: r.rank)


def rss_kib() -> int:
    """This process's resident set size now (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def report_peak(rank: int, baseline_kib: int) -> None:
    """Print this rank's JSON record (baseline and peak RSS, MiB) and leave the group."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = {"rank": rank, "baseline_mib": baseline_kib / 1024, "peak_mib": peak_kib / 1024}
    sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


def main() -> None:
    impl, size, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flags = sys.argv[4:]
    options = gpt.Options(bf16="bf16" in flags, reshard_after_forward="keep" not in flags)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_kib = rss_kib()
    model, opt = gpt.build(impl, size, world, options)
    for step in range(steps):
        gpt.train_step(model, opt, gpt.batch(size, step, rank, world))
    report_peak(rank, baseline_kib)


if __name__ == "__main__":
    main()
