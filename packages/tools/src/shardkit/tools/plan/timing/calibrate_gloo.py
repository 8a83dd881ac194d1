"""gloo's collectives and the engine's host work per collective, timed between processes.

A CPU profile's communication (:func:`shardkit.tools.plan.timing.calibrate.measure`) is measured
the way a training job meets it: ``ranks`` processes of this Python (``python -m`` this
module), one torch thread each, joined by a ``FileStore`` in a temporary folder. Threads of one
process (``bandwidth.measure_gloo_gbps``) share one interpreter and move bytes faster than
processes do, and a single size cannot see how gloo's rate changes with a message's size
(over loopback it halves past the socket buffers). Each process times:

- **curves**: an all-gather and a reduce-scatter as shardkit's engine runs them on gloo
  (point to point with each peer, the reduce-scatter's rows then summed) at sizes from
  4 KiB to 64 MiB sent per rank, three sizes an octave, each the best of a few repeats.
  The buffers of a size are rotated so that each collective reads memory the previous ones
  did not, as a training step's are (caches hold the last activations, not the next unit's
  shards). Noise is not allowed to make a larger collective cheaper: each curve is made
  non-decreasing by pooling adjacent violators (isotonic regression), so the step-time
  model sees one monotone rate.
- **contention**: a loop of matrix multiplies alone, the exchanges alone, then both with
  the exchanges issued asynchronously: the fraction of the
  collectives' time the loop still lost (gloo's threads move the bytes on the cores the
  compute runs on).
- **collective_overhead_s**: ``fully_shard`` training steps of a model of many tiny units and
  of few; each unit beyond the few costs three collectives (an all-gather in forward and in
  backward, a reduce-scatter) and the engine's hooks around them. The unit's time beyond its
  collectives' (on the curves) and beyond the same layers trained without sharding, per
  collective, is the engine's host work per collective.

Rank 0 writes the figures as JSON to a file the caller names; the caller reads them as
untrusted (``calibrate`` range-checks every figure). A process that fails or outlives the
timeout is killed, and the caller gets a ``RuntimeError`` with its last output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CURVE_SIZES", "isotonic", "measure_gloo"]

CURVE_SIZES: tuple[int, ...] = tuple(int(2 ** (12 + i / 3)) // 4 * 4 for i in range(43))
"""Bytes sent per rank at which the curves are timed: 4 KiB to 64 MiB, three an octave."""
_REPEATS = 5
_ROTATION_BYTES = 96 * 1024 * 1024  # buffers of one size, rotated, span more than a cache
_TIMEOUT_S = 300.0
_MATMUL = (256, 512, 1024)
_MATMULS = 4  # compute about twice an exchange's time, so the loss is not lost in noise
_OVERLAP_BYTES = 8 * 1024 * 1024
_OVERLAPS = 4
_TRIPLES = 5
_UNITS = (2, 32)  # tiny units in the two models whose difference is a unit's cost
_STEPS = 12


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` (least squares, pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight = blocks.pop()
            blocks[-1][0] = (blocks[-1][0] * blocks[-1][1] + mean * weight) / (
                blocks[-1][1] + weight
            )
            blocks[-1][1] += weight
    return [mean for mean, weight in blocks for _ in range(int(weight))]


def measure_gloo(
    ranks: int, *, sizes: Sequence[int] = CURVE_SIZES, repeats: int = _REPEATS
) -> dict[str, Any]:
    """Time gloo between ``ranks`` processes of this Python (see the module's docstring).

    Returns:
        ``{"all_gather": [[bytes, seconds], ...], "reduce_scatter": [...], "contention": f,
        "collective_overhead_s": s}``.

    Raises:
        RuntimeError: a process failed or ran past the timeout.
    """
    if ranks < 2:
        raise ValueError(f"measure_gloo: needs at least 2 ranks, got {ranks}")
    with tempfile.TemporaryDirectory(prefix="shardkit-calibration-") as folder:
        out = Path(folder) / "figures.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", __name__, "--ranks", str(ranks), "--folder", folder]
        argv += ["--repeats", str(repeats), "--sizes", ",".join(map(str, sizes))]
        procs = [
            subprocess.Popen(  # this Python, this module: nothing from outside
                [*argv, "--rank", str(rank)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(ranks)
        ]
        _wait_all(procs)
        try:
            figures: dict[str, Any] = json.loads(out.read_text())
        except (OSError, ValueError) as err:
            raise RuntimeError(f"gloo calibration wrote no figures: {err}") from err
    return figures


def _wait_all(procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    failed: str | None = None
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            output, failed = "", f"rank {rank} ran past {_TIMEOUT_S:.0f} s"
            break
        if proc.returncode != 0:
            failed = f"rank {rank} exited {proc.returncode}: {output[-2000:]}"
            break
    if failed is None:
        return
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    raise RuntimeError(f"gloo calibration failed: {failed}")


def _best(run: Callable[[], object], repeats: int, before: Callable[[int], object]) -> float:
    """The fastest of ``repeats`` runs after a warm-up, the ranks meeting before each."""
    best = math.inf
    for repeat in range(repeats + 1):
        before(repeat)
        dist.barrier()
        start = time.perf_counter()
        run()
        if repeat:
            best = min(best, time.perf_counter() - start)
    return best


def _exchange(rows: list[torch.Tensor], received: torch.Tensor) -> None:
    """Row j to rank j, each peer's row for us into ``received`` (ours left out).

    The engine's transport on gloo, point to point as ``runtime.collectives`` runs it, for
    an all-gather (every row this rank's shard) and a reduce-scatter (then summed).
    """
    rank, ranks = dist.get_rank(), dist.get_world_size()
    works = []
    for peer in range(ranks):
        if peer == rank:
            continue
        works.append(dist.irecv(received[peer if peer < rank else peer - 1], src=peer))
        works.append(dist.isend(rows[peer], dst=peer))
    for work in works:
        if work is not None:
            work.wait()


def _curves(ranks: int, sizes: Sequence[int], repeats: int) -> dict[str, list[list[float]]]:
    timed: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": []}
    for sent in sizes:
        gather, scatter = _timed_at(ranks, sent, repeats)
        timed["all_gather"].append(gather)
        timed["reduce_scatter"].append(scatter)
    return {
        kind: [[float(s), t] for s, t in zip(sizes, isotonic(seconds), strict=True)]
        for kind, seconds in timed.items()
    }


def _timed_at(ranks: int, sent: int, repeats: int) -> tuple[float, float]:
    """Seconds of the engine's all-gather and reduce-scatter sending ``sent`` bytes a rank."""
    rank = dist.get_rank()
    numel = max(sent // (4 * (ranks - 1)), 1)  # sent = (ranks - 1) rows of 4-byte floats
    copies = min(max(_ROTATION_BYTES // (3 * ranks * numel * 4), 2), repeats + 1)
    buffers = [
        (torch.ones(numel), torch.empty(ranks - 1, numel), torch.ones(ranks, numel))
        for _ in range(copies)
    ]
    chosen = buffers[0]

    def rotate(repeat: int) -> None:
        nonlocal chosen
        chosen = buffers[repeat % copies]

    def gather() -> None:
        shard, received, _ = chosen
        _exchange([shard] * ranks, received)

    def scatter() -> None:
        output, received, rows = chosen
        _exchange(list(rows), received)
        torch.add(rows[rank], received.sum(dim=0), out=output)

    return _best(gather, repeats, rotate), _best(scatter, repeats, rotate)


def _contention(ranks: int, repeats: int) -> float:
    m, k, n = _MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    numel = _OVERLAP_BYTES // 4
    shard, received = torch.ones(numel), torch.empty(ranks - 1, numel)
    rank = dist.get_rank()

    def compute() -> None:
        for _ in range(_MATMULS):
            torch.mm(a, b)

    def collectives() -> None:
        for _ in range(2 * _OVERLAPS):
            _exchange([shard] * ranks, received)

    def both() -> None:
        for _ in range(2 * _OVERLAPS):
            works = []
            for peer in range(ranks):
                if peer != rank:
                    works.append(dist.irecv(received[peer if peer < rank else peer - 1], src=peer))
                    works.append(dist.isend(shard, dst=peer))
            compute()
            for work in works:
                if work is not None:
                    work.wait()

    def nothing(repeat: int) -> None:
        return None

    # The loss is a difference of two step times: the median of a few independent triples
    # keeps one noisy run from deciding it.
    fractions = []
    for _ in range(_TRIPLES):
        alone = 2 * _OVERLAPS * _best(compute, repeats, nothing)
        comm = _best(collectives, repeats, nothing)
        lost = _best(both, repeats, nothing) - alone
        fractions.append(min(max(lost / comm, 0.0), 1.0))
    return statistics.median(fractions)


def _unit_seconds(units: int, mesh: Any, repeats: int, *, sharded: bool) -> float:
    from shardkit.core import fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(units)]
    model = torch.nn.Sequential(*layers)
    if sharded:
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    inputs = torch.randn(4, 16)

    def step() -> None:
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    return _best(step, max(repeats, _STEPS), lambda repeat: None)


def _overhead(ranks: int, curves: dict[str, list[list[float]]], repeats: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.tools.plan.timing.hardware import interpolate

    mesh = init_device_mesh("cpu", (ranks,))
    few, many = _UNITS
    extra = many - few
    sharded = _unit_seconds(many, mesh, repeats, sharded=True)
    sharded -= _unit_seconds(few, mesh, repeats, sharded=True)
    plain = _unit_seconds(many, mesh, repeats, sharded=False)
    plain -= _unit_seconds(few, mesh, repeats, sharded=False)
    shard_bytes = math.ceil((16 * 16 + 16) / ranks) * 4 * (ranks - 1)  # a Linear(16, 16)'s

    def on_curve(kind: str) -> float:
        points = tuple((int(s), t) for s, t in curves[kind])
        return interpolate(points, shard_bytes)

    collectives = 2 * on_curve("all_gather") + on_curve("reduce_scatter")
    return max((sharded - plain) / extra - collectives, 0.0) / 3


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of shardkit's gloo calibration")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--sizes", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = dist.FileStore(str(args.folder / "store"), args.ranks)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=_TIMEOUT_S),
    )
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        curves = _curves(args.ranks, sizes, args.repeats)
        figures = {
            **curves,
            "contention": _contention(args.ranks, args.repeats),
            "collective_overhead_s": _overhead(args.ranks, curves, args.repeats),
        }
        if args.rank == 0:
            partial = args.folder / "figures.json.partial"
            partial.write_text(json.dumps(figures))
            partial.replace(args.folder / "figures.json")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
