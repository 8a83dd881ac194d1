"""One implementation's full-state-dict save on rank 0: time and peak RSS above the start.

Usage: torchrun --nproc-per-node 2 benchmarks/full_state_dict_run.py IMPL SIZE OUTDIR
IMPL 'shardkit' streams with save_full_state_dict; 'torch' is torch's fully_shard with
get_model_state_dict(full_state_dict=True, cpu_offload=True) then torch.save on rank 0.
SIZE 'tp' is the FSDP x TP workload instead (benchmarks/tp_workload.py: dp 2 x tp 2, run it
with --nproc-per-node 4). Prints one JSON line from rank 0.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.train_gpt import GPT as TPGPT

from benchmarks import gpt, tp_workload
from shardkit.tools.plan.gpt import GPT


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _save(impl: str, model: object, path: Path) -> None:
    if impl == "shardkit":
        from shardkit.core import save_full_state_dict

        assert isinstance(model, torch.nn.Module)
        save_full_state_dict(model, path)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    assert isinstance(model, torch.nn.Module)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        torch.save(state, path)
    del state
    dist.barrier()


def _plain_model(size: str) -> Any:
    """The model of ``size`` on the meta device, for its byte count."""
    with torch.device("meta"):
        return TPGPT(tp_workload.CONFIG) if size == "tp" else GPT(gpt.SIZES[size].model)


def main() -> None:
    impl, size, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if size == "tp":
        model, *_ = tp_workload.build(impl, (2, 2))
    else:
        model, _ = gpt.build(impl, size, dist.get_world_size())
    path = out / f"full_{impl}.{'safetensors' if impl == 'shardkit' else 'pt'}"
    times, peaks = [], []
    for _ in range(3):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        start_rss = _status("VmRSS")
        started = time.perf_counter()
        _save(impl, model, path)
        times.append(time.perf_counter() - started)
        peaks.append(_status("VmHWM") - start_rss)
    plain = _plain_model(size)
    model_mib = sum(p.numel() * p.element_size() for p in plain.parameters())
    block_mib = sum(p.numel() * p.element_size() for p in plain.blocks[0].parameters())
    root_mib = model_mib - block_mib * len(plain.blocks)  # embeddings, final norm, head
    if dist.get_rank() == 0:
        record = {
            "impl": impl,
            "seconds": statistics.median(times),
            "peak_above_start_mib": max(peaks),
            "model_mib": model_mib / 2**20,
            "largest_group_mib": max(block_mib, root_mib) / 2**20,
            "file_mib": path.stat().st_size / 2**20,
        }
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
