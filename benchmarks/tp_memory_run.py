"""One implementation's peak RSS per rank under FSDP x TP (dp 2 x tp 2), for bench_tp.py.

Usage: torchrun --nproc-per-node 4 benchmarks/tp_memory_run.py IMPL STEPS
Prints one JSON line per rank: {"rank", "peak_mib"}.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt, tp_workload


def main() -> None:
    impl, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt, dp_rank = tp_workload.build(impl, (2, 2))
    for step in range(steps):
        gpt.train_step(model, opt, tp_workload.batch(step, dp_rank, 2))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write(json.dumps({"rank": dist.get_rank(), "peak_mib": peak_mib}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
