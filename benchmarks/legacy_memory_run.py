"""Peak RSS of the FSDP1 script's training, per rank: run under torchrun.

Usage: torchrun --nproc-per-node 2 benchmarks/legacy_memory_run.py IMPL STEPS
Prints one JSON line per rank: {"rank", "baseline_mib", "peak_mib"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import legacy_workload
from benchmarks.memory_run import report_peak, rss_kib


def main() -> None:
    impl, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_kib = rss_kib()
    model, opt = legacy_workload.setup(impl, rank)
    for step in range(steps):
        legacy_workload.timed_step(model, opt, legacy_workload.batch(step, rank, world))
    report_peak(rank, baseline_kib)


if __name__ == "__main__":
    main()
