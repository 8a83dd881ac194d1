"""Issue 83's Muon on a GPU: bit-identity at one GPU, and its step, floor and peak at scale.

Usage::

    torchrun --nproc-per-node 1 benchmarks/cuda_muon_run.py parity [--device cuda|cpu]
        [--size 217m] [--steps 3]
    python benchmarks/cuda_muon_run.py batched [--device cuda|cpu] [--size 217m]
    python benchmarks/cuda_muon_run.py point CONFIG SIZE WORLD [--device cuda|cpu]
        [--steps 10] [--warmup 2] [--rounds 6]

``--foreach`` (any mode) opens Muon's foreach elementwise path on the device (``muon.
_FOREACH_DEVICES``, shut on CUDA until a parity run with it keeps every bit): the momentum,
the blend, the cast, the decay and the add as five operators a step, not five a matrix.

``parity`` (one rank, NCCL on CUDA, deterministic algorithms): the GPT in fp32, trained
``steps`` steps by shardkit's Muon on ``fully_shard``'s blocks' matrices (AdamW on the rest)
and by ``torch.optim.Muon`` on the same matrices of the unsharded model, same seed and data.
Prints whether losses and every parameter are bit-identical.

``batched``: whether Newton-Schulz with batched matmuls (``baddbmm`` over the matrices of one
shape, the path ``newton_schulz._BATCHED_DEVICES`` opens per device) gives each matrix the bits
of one at a time on this device, on the GPT's shapes, and the time of each way. On the CPU it
does not (its tests show a last bit); a GPU that keeps the bits may batch: fewer launches.

``point``: one configuration per process (its own peak) on torch's fake process group at W
(rank 0 of W; every collective returns at once), measured as ``fake_scale.py`` measures a
point: ``adamw`` (shardkit's ``fully_shard``, AdamW on every parameter), ``muon`` (shardkit's
Muon on the blocks' matrices, AdamW on the rest), and at W=1 ``plain-muon``
(``torch.optim.Muon`` on the unsharded model: a single GPU's Muon). At W=1 the model is fp32,
as a single GPU trains it; at W>1 bf16 mixed precision with activation checkpointing, built on
the meta device (``fake_scale.OPTIONS``). Then, for the Muon configurations, the optimizer
step alone is timed against AdamW's on every parameter, on the same gradients in the same
process (alternating which goes first, ``rounds`` rounds), and this rank's share of the
Newton-Schulz work alone (the floor, ``muon_baselines.newton_schulz_share``):
``over_floor`` = (Muon's optimizer step - AdamW's) / the floor, issue 83's at most 1.1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpt
from benchmarks.fake_scale import OPTIONS
from benchmarks.muon_baselines import newton_schulz_share
from benchmarks.muon_run import MUON_LR

CONFIGS = ("adamw", "muon", "plain-muon")


def _takes_muon(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and name.startswith("blocks.")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _optimizers(model: Any, config: str) -> list[torch.optim.Optimizer]:
    """``config``'s optimizers for ``model``: AdamW alone, or Muon's with AdamW on the rest."""
    named = list(model.named_parameters())
    if config == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01)]
    matrices = [(n, p) for n, p in named if _takes_muon(n, p)]
    rest = torch.optim.AdamW(
        [p for n, p in named if not _takes_muon(n, p)], lr=1e-3, weight_decay=0.01
    )
    if config == "muon":
        from shardkit.core.optim import Muon

        return [Muon(matrices, lr=MUON_LR), rest]
    return [torch.optim.Muon([p for _, p in matrices], lr=MUON_LR), rest]


def _forward_backward(model: Any, data: torch.Tensor) -> torch.Tensor:
    out = model(data[:, :-1])
    loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1))
    loss.backward()
    return loss


def _step(model: Any, opts: list[torch.optim.Optimizer], data: torch.Tensor) -> float:
    for opt in opts:
        opt.zero_grad()
    loss = _forward_backward(model, data)
    for opt in opts:
        opt.step()
    return float(loss.item())


def _full(param: torch.Tensor) -> torch.Tensor:
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    return full.detach()


def parity(device: str, size: str, steps: int) -> dict[str, Any]:
    """shardkit's Muon on ``fully_shard`` against torch's Muon unsharded, bit for bit."""
    plain, _ = gpt.build("local", size, 1, device=device)
    sharded, _ = gpt.build("shardkit", size, 1, device=device)
    plain_opts, sharded_opts = _optimizers(plain, "plain-muon"), _optimizers(sharded, "muon")
    record: dict[str, Any] = {"case": "muon-parity", "size": size, "steps": steps}
    losses: dict[str, list[float]] = {"plain": [], "shardkit": []}
    for step in range(steps):
        data = gpt.batch(size, step, 0, 1).to(device)
        losses["plain"].append(_step(plain, plain_opts, data))
        losses["shardkit"].append(_step(sharded, sharded_opts, data))
    worst, different = 0.0, []
    theirs = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        ours, other = _full(param), theirs[name].detach()
        if not torch.equal(ours, other):
            different.append(name)
            worst = max(worst, (ours.float() - other.float()).abs().max().item())
    record.update(
        losses=losses,
        identical=not different and losses["plain"] == losses["shardkit"],
        different=different[:10],
        max_param_diff=worst,
        params=len(theirs),
        matrices=sum(_takes_muon(n, p) for n, p in theirs.items()),
    )
    return record


def batched(device: str, size: str, repeats: int = 5) -> dict[str, Any]:
    """Batched Newton-Schulz against one matrix at a time on this device: bits and time."""
    from shardkit.core.optim import newton_schulz as ns

    shapes: dict[tuple[int, int], int] = {}
    for name, param in _shapes(size):
        if _takes_muon(name, param):
            shape = (param.size(0), param.size(1))
            shapes[shape] = shapes.get(shape, 0) + 1
    gen = torch.Generator().manual_seed(0)
    inputs = {s: torch.randn(n, *s, generator=gen).bfloat16().to(device) for s, n in shapes.items()}
    args = (ns.DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    results: dict[str, Any] = {"case": "muon-batched", "size": size, "shapes": {}}
    for shape, batch in inputs.items():
        one_by_one = ns.orthogonalize_batch(batch, *args)  # the device's default: one at a time
        with _batched_on(batch.device.type):
            together = ns.orthogonalize_batch(batch, *args)
        results["shapes"][f"{shape[0]}x{shape[1]}"] = {
            "matrices": batch.size(0),
            "identical": bool(torch.equal(one_by_one, together)),
            "max_diff": (one_by_one.float() - together.float()).abs().max().item(),
        }

    def all_shapes() -> None:
        for batch in inputs.values():
            ns.orthogonalize_batch(batch, *args)

    results["one_by_one_s"] = _best(device, repeats, all_shapes)
    with _batched_on(device):
        results["batched_s"] = _best(device, repeats, all_shapes)
    results["identical"] = all(s["identical"] for s in results["shapes"].values())
    return results


@contextlib.contextmanager
def _batched_on(device_type: str) -> Iterator[None]:
    """Open Newton-Schulz's batched path on ``device_type`` for a while (a probe: the core
    keeps it shut until a check like this one says the device keeps the bits)."""
    from shardkit.core.optim import newton_schulz as ns

    kept = ns._BATCHED_DEVICES
    ns._BATCHED_DEVICES = kept | {device_type}
    try:
        yield
    finally:
        ns._BATCHED_DEVICES = kept


def _shapes(size: str) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        return list(gpt._model(size).named_parameters())


def _best(device: str, repeats: int, work: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def point(
    config: str, size: str, world: int, *, device: str, steps: int, warmup: int, rounds: int
) -> dict[str, Any]:
    """One configuration at W on a fake group: its step, peak, and (Muon's) optimizer step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if config == "plain-muon" and world != 1:
        raise SystemExit("plain-muon is a single GPU's Muon: W=1 only")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        options = OPTIONS if world > 1 else gpt.Options()
        impl = "local" if config == "plain-muon" else "shardkit"
        model, _ = gpt.build(impl, size, world, options, device=device)
        opts = _optimizers(model, config)
        for step in range(warmup):
            _step(model, opts, gpt.batch(size, step, 0, world).to(device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(steps):
            data = gpt.batch(size, warmup + step, 0, world).to(device)
            _sync(device)
            started = time.perf_counter()
            _step(model, opts, data)
            _sync(device)
            times.append(time.perf_counter() - started)
        record: dict[str, Any] = {
            "config": config, "size": size, "world": world, "device": device,
            "fp32": world == 1, "step_s": statistics.median(times), "steps": steps,
        }  # fmt: skip
        if device == "cuda":
            stats = torch.cuda.memory_stats()
            record["peak_alloc_bytes"] = torch.cuda.max_memory_allocated()
            record["peak_requested_bytes"] = stats.get("requested_bytes.all.peak", 0)
            record["gpu"] = torch.cuda.get_device_name()
        stats_of = getattr(opts[0], "last_step_stats", None)
        if stats_of is not None:
            record["muon_stats"] = dataclasses.asdict(stats_of)
        if config != "adamw":
            record.update(_optimizer_step(model, opts, size, world, device, rounds))
        return record
    finally:
        dist.destroy_process_group()


def _optimizer_step(
    model: Any, opts: list[torch.optim.Optimizer], size: str, world: int, device: str,
    rounds: int,
) -> dict[str, Any]:  # fmt: skip
    """The optimizer step alone, Muon's pair against AdamW on every parameter, same gradients.

    Each round runs one forward and backward, then both steps on its gradients (the order
    alternating); the values the steps write do not change what they cost.
    """
    adamw = _optimizers(model, "adamw")[0]
    data = gpt.batch(size, 0, 0, world).to(device)
    for opt in (*opts, adamw):
        opt.zero_grad()
    _forward_backward(model, data)
    adamw.step()  # its state, outside the timing

    def timed(steps: list[torch.optim.Optimizer]) -> float:
        _sync(device)
        started = time.perf_counter()
        for opt in steps:
            opt.step()
        _sync(device)
        return time.perf_counter() - started

    muon_s, adamw_s = [], []
    for k in range(rounds):
        for opt in (*opts, adamw):
            opt.zero_grad()
        _forward_backward(model, data)
        if k % 2:
            adamw_s.append(timed([adamw]))
            muon_s.append(timed(opts))
        else:
            muon_s.append(timed(opts))
            adamw_s.append(timed([adamw]))
    shapes = [(p.size(0), p.size(1)) for n, p in model.named_parameters() if _takes_muon(n, p)]
    floor = newton_schulz_share(shapes, 0, world, repeats=rounds, device=device)
    muon, other = statistics.median(muon_s), statistics.median(adamw_s)
    return {
        "optimizer_muon_s": muon,
        "optimizer_adamw_s": other,
        "floor_s": floor,
        "over_floor": (muon - other) / floor,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("mode", choices=("parity", "batched", "point"))
    parser.add_argument("point", nargs="*", help="point: CONFIG SIZE WORLD")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="217m")
    parser.add_argument("--steps", type=int, default=0, help="default: parity 3, point 10")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--foreach", action="store_true",
        help="open Muon's foreach elementwise path on --device (a probe: shut on CUDA)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.foreach:
        from shardkit.core.optim import muon

        muon._FOREACH_DEVICES = muon._FOREACH_DEVICES | {args.device}
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.mode == "parity":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            record = parity(args.device, args.size, args.steps or 3)
        finally:
            dist.destroy_process_group()
    elif args.mode == "batched":
        record = batched(args.device, args.size)
    else:
        if len(args.point) != 3 or args.point[0] not in CONFIGS:
            raise SystemExit(f"point takes CONFIG SIZE WORLD, CONFIG one of {CONFIGS}")
        config, size, world = args.point[0], args.point[1], int(args.point[2])
        record = point(
            config, size, world, device=args.device, steps=args.steps or 10,
            warmup=args.warmup, rounds=args.rounds,
        )  # fmt: skip
    record["foreach"] = args.foreach
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
