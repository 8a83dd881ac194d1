"""Training with each reduction mode: the demo GPT on the shipped corpus, loss curves by seed.

One process per rank on gloo (``torch.multiprocessing``), W ranks; each seed trains the same
model from the same initialization on the same batches (the demo's sampler: a fixed global
batch at any W) once per mode, and records the global batch's mean loss at every step:

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.reduce_precision_training \\
        --world 2 --steps 1000 --seeds 0 1 2

writes ``benchmarks/.results/reduce-precision-training-w2.json``; ``--plot`` draws every saved
world size's curves into ``docs/images/reduce-precision-training.png`` and prints the table
of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from demo.batches import BatchSampler, load_corpus
from demo.model import GPT, ModelConfig
from torch.multiprocessing.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / ".results"
PLOT = ROOT / "docs" / "images" / "reduce-precision-training.png"
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 64}
GLOBAL_BATCH = 16
LR = 3e-3
# Each mode: the ReducePrecision fields (None: the default, torch's float32 reduction).
MODES: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "bf16 wire, fp32 sum": {"wire_dtype": "bfloat16"},
    "int8 wire + error feedback": {"wire_dtype": "int8", "block_size": 256, "error_feedback": True},
}
TAIL = 50  # the final loss: the mean of the last TAIL steps (one step's batch is noisy)
# Step time (--timing): every mode above, and the numerics check's cost on bfloat16's.
TIMED: dict[str, dict[str, Any] | None] = {
    **MODES,
    "int8 wire": {"wire_dtype": "int8", "block_size": 256},
    "bf16 wire, check every 10": {"wire_dtype": "bfloat16", "check_every": 10},
    "bf16 wire, check every step": {"wire_dtype": "bfloat16", "check_every": 1},
}


def _build(fields: dict[str, Any] | None, seed: int) -> tuple[Any, torch.optim.Optimizer]:
    """The demo GPT sharded per block, with ``fields`` as its ReducePrecision, and AdamW."""
    from shardkit.core import ReducePrecision, fully_shard

    torch.manual_seed(seed)
    model: Any = GPT(ModelConfig(**MODEL))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if fields is not None:
        model.set_reduce_precision(ReducePrecision(**fields))
    return model, torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))


def _sampler(seed: int, rank: int, world: int) -> BatchSampler:
    return BatchSampler(
        data=load_corpus(ROOT / "demo" / "data" / "corpus.txt"),
        seq_len=MODEL["seq_len"],
        batch_per_rank=GLOBAL_BATCH // world,
        rank=rank,
        world=world,
        seed=seed,
    )


def _step(model: Any, optimizer: torch.optim.Optimizer, batch: tuple[Any, Any]) -> Any:
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _train(mode: str, seed: int, steps: int, rank: int, world: int) -> tuple[list[float], float]:
    """One run; returns the global mean loss of every step and the seconds per step."""
    model, optimizer = _build(MODES[mode], seed)
    sampler = _sampler(seed, rank, world)
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        total = _step(model, optimizer, sampler.batch(step)).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, (time.perf_counter() - started) / steps


def _timing(rank: int, world: int, rounds: int) -> dict[str, float]:
    """Each timed mode's median step (slowest rank), its steps alternating with the others'."""
    built = {mode: _build(fields, 0) for mode, fields in TIMED.items()}
    sampler = _sampler(0, rank, world)
    times: dict[str, list[float]] = {mode: [] for mode in TIMED}
    names = list(TIMED)
    for index in range(rounds + 2):  # two warm-up rounds
        order = names[index % len(names) :] + names[: index % len(names)]
        for mode in order:
            dist.barrier()
            started = time.perf_counter()
            _step(*built[mode], sampler.batch(index))
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index >= 2:
                times[mode].append(float(elapsed))
    return {mode: statistics.median(t) for mode, t in times.items()}


def _worker(rank: int, world: int, steps: int, seeds: list[int], out: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {"world": world, "steps": steps, "model": MODEL, "runs": []}
    try:
        if not seeds:  # --timing
            medians = _timing(rank, world, steps)
            if rank == 0:
                Path(out).write_text(json.dumps({"world": world, "median_s": medians}))
            return
        for seed in seeds:
            for mode in MODES:
                losses, per_step = _train(mode, seed, steps, rank, world)
                results["runs"].append(
                    {"mode": mode, "seed": seed, "losses": losses, "step_s": per_step}
                )
                if rank == 0:
                    tail = statistics.mean(losses[-TAIL:])
                    sys.stdout.write(
                        f"W={world} seed {seed} {mode}: {tail:.4f}, {per_step * 1e3:.1f} ms/step\n"
                    )
                    sys.stdout.flush()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run(world: int, steps: int, seeds: list[int]) -> Path:
    """Train every mode for every seed at ``world`` ranks; the results' path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "timing" if not seeds else "training"
    out = RESULTS / f"reduce-precision-{name}-w{world}.json"
    os.environ.setdefault("MASTER_PORT", str(29_500 + world + (0 if seeds else 10)))
    spawn(_worker, args=(world, steps, seeds, str(out)), nprocs=world, join=True)
    return out


def summary(paths: list[Path]) -> str:
    """The final losses by mode and seed, and each mode's distance from float32's."""
    lines = []
    for path in paths:
        data = json.loads(path.read_text())
        finals: dict[str, dict[int, float]] = {}
        times: dict[str, list[float]] = {}
        for r in data["runs"]:
            finals.setdefault(r["mode"], {})[r["seed"]] = statistics.mean(r["losses"][-TAIL:])
            times.setdefault(r["mode"], []).append(r["step_s"])
        fp32 = finals["fp32"]
        spread = max(fp32.values()) - min(fp32.values())
        lines.append(
            f"W={data['world']}, {data['steps']} steps, final loss (mean of the last {TAIL}); "
            f"fp32's seed-to-seed spread {spread:.4f}"
        )
        for mode, by_seed in finals.items():
            seeds = sorted(by_seed)
            gaps = [by_seed[s] - fp32[s] for s in seeds]
            cells = "  ".join(f"seed {s}: {by_seed[s]:.4f}" for s in seeds)
            ms = statistics.median(times[mode]) * 1e3
            worst = max(abs(g) for g in gaps)
            lines.append(f"  {mode:<28} {cells}  |gap to fp32| <= {worst:.4f}  {ms:.1f} ms/step")
    return "\n".join(lines)


def plot(paths: list[Path]) -> None:
    """Loss curves (a moving mean over 20 steps) of every mode, seed and world size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * len(paths), 4))
    FigureCanvasAgg(figure)
    colors = {mode: f"C{i}" for i, mode in enumerate(MODES)}
    for index, path in enumerate(paths):
        data = json.loads(path.read_text())
        axes = figure.add_subplot(1, len(paths), index + 1)
        for r in data["runs"]:
            losses = torch.tensor(r["losses"])
            smooth = losses.unfold(0, 20, 1).mean(dim=1)
            label = r["mode"] if r["seed"] == data["runs"][0]["seed"] else None
            axes.plot(range(19, len(losses)), smooth, color=colors[r["mode"]], lw=0.8, label=label)
        axes.set_title(
            f"demo GPT, W={data['world']}, {len({r['seed'] for r in data['runs']})} seeds"
        )
        axes.set_xlabel("step")
        axes.set_ylabel("loss (moving mean of 20 steps)")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", action="store_true", help="only draw and summarize saved runs")
    parser.add_argument(
        "--timing", type=int, metavar="ROUNDS", help="time each mode's step instead (paired)"
    )
    args = parser.parse_args(argv)
    if args.timing:
        out = run(args.world, args.timing, [])
        medians = json.loads(out.read_text())["median_s"]
        for mode, seconds in medians.items():
            ratio = seconds / medians["fp32"]
            sys.stdout.write(f"{mode:<30} {seconds * 1e3:7.1f} ms  {ratio:.2f} of fp32's\n")
        return 0
    if not args.plot:
        run(args.world, args.steps, args.seeds)
    paths = sorted(RESULTS.glob("reduce-precision-training-w*.json"))
    plot(paths)
    sys.stdout.write(summary(paths) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
