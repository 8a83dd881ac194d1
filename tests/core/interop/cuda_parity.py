"""CUDA parity with torch's fully_shard (NCCL, one process per GPU), case by case.

Usage: torchrun --nproc-per-node N tests/core/interop/cuda_parity.py [--deterministic] [CASE ...]

Trains benchmarks/gpt.py's "small" GPT (8.45M) with AdamW, shardkit and torch's fully_shard
alike (same seed, same data), for each case: fp32, bf16 mixed precision, bf16 +
``CPUOffloadPolicy(pin_memory=True)``, activation checkpointing, gradient accumulation over two
microbatches, no resharding after forward, and blocks compiled with inductor before sharding
(torchtitan's order). Each rank prints one JSON line per case: both engines' losses, whether
losses and this rank's shards are bit-identical, the largest shard difference, or the error.

``--deterministic`` sets ``torch.use_deterministic_algorithms(True)`` and cuBLAS's workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``) before any CUDA work. Then at one GPU the engines must
agree bit for bit (``check``); across GPUs the reductions run through NCCL in buffers laid out
alike, and agreement within 1e-5 (fp32) or 1e-2 (bf16) of a loss is accepted. ``--device cpu``
runs the same on gloo: a check of this script on a CPU machine (where torch's offload cannot
pin memory, so the offload case fails on torch's side).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import gpt

SIZE = "small"
STEPS = 5
CASES: dict[str, gpt.Options] = {
    "fp32": gpt.Options(),
    "bf16": gpt.Options(bf16=True),
    "offload": gpt.Options(bf16=True, offload=True),
    "checkpoint": gpt.Options(bf16=True, checkpoint=True),
    "accumulate": gpt.Options(bf16=True),
    "no-reshard": gpt.Options(bf16=True, reshard_after_forward=False),
    "compile": gpt.Options(compile=True),
    "compile-bf16": gpt.Options(bf16=True, compile=True),
}


def _step(model: Any, opt: torch.optim.Optimizer, data: torch.Tensor, micro: int) -> float:
    """One optimizer step over ``micro`` microbatches; the loss of this rank's batch."""
    opt.zero_grad()
    total = 0.0
    parts = data.chunk(micro)
    for i, part in enumerate(parts):
        if micro > 1:
            model.set_requires_gradient_sync(i == len(parts) - 1)
        out = model(part[:, :-1])
        loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), part[:, 1:].reshape(-1))
        (loss / micro).backward()
        total += loss.item() / micro
    opt.step()
    return total


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter, on the CPU (no collective: offloaded ones too)."""
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def _train(impl: str, case: str, device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    model, opt = gpt.build(impl, SIZE, world, CASES[case], device=device)
    micro = 2 if case == "accumulate" else 1
    losses = []
    for step in range(STEPS):
        data = gpt.batch(SIZE, step, rank, world).to(device)
        losses.append(_step(model, opt, data, micro))
    return losses, _shards(model)


def run_case(case: str, deterministic: bool, device: str = "cuda") -> dict[str, Any]:
    """Train both engines on ``case``; this rank's record."""
    record: dict[str, Any] = {
        "case": case,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "deterministic": deterministic,
    }
    try:
        ours, our_shards = _train("shardkit", case, device)
        theirs, their_shards = _train("torch", case, device)
    except Exception as error:  # reported per case: the other cases still run
        record["error"] = "".join(traceback.format_exception_only(error)).strip()
        record["traceback"] = traceback.format_exc()[-3000:]
        return record
    diffs = [
        (our_shards[k].float() - v.float()).abs().max().item() if v.numel() else 0.0
        for k, v in their_shards.items()
    ]
    record.update(
        losses={"shardkit": ours, "torch": theirs},
        names_match=our_shards.keys() == their_shards.keys(),
        identical=ours == theirs and all(d == 0 for d in diffs),
        max_param_diff=max(diffs),
    )
    return record


def check(records: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a run's records (empty: all good); see the module docstring."""
    problems = []
    for r in records:
        label = f"{r['case']} (rank {r['rank']} of {r['world']})"
        if "error" in r:
            problems.append(f"{label}: {r['error']}")
        elif not r["names_match"]:
            problems.append(f"{label}: parameter names differ from torch's")
        elif r["identical"]:
            continue
        elif r["world"] == 1 and r["deterministic"]:
            problems.append(f"{label}: not bit-identical (max shard diff {r['max_param_diff']})")
        else:
            rtol = 1e-5 if r["case"] in ("fp32", "compile") else 1e-2
            ours, theirs = r["losses"]["shardkit"], r["losses"]["torch"]
            if any(abs(a - b) > rtol * abs(b) for a, b in zip(ours, theirs, strict=True)):
                problems.append(f"{label}: losses {ours} differ from torch's {theirs}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo")
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    for case in args.cases or CASES:
        record = run_case(case, args.deterministic, args.device)
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
