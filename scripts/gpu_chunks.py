"""The chunks of ``make check-gpu``: each runs GPU tests or benchmarks and reports table rows.

Every chunk runs its work in child processes (their own CUDA context, their own peak memory)
through ``Runner``, which keeps the whole invocation inside its time budget, and turns their
JSON lines into ``Row``s with the same checks the pytest GPU tests make. scripts/check_gpu.py
picks the chunks, runs them and prints the table.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_export_chunk import export  # noqa: E402
from scripts.gpu_muon_chunk import muon  # noqa: E402
from scripts.gpu_planner_chunk import planner  # noqa: E402
from scripts.gpu_runner import Row, Runner  # noqa: E402  (after the path)
from scripts.gpu_snapshot_chunk import memory_snapshots  # noqa: E402
from tests.core.interop import (  # noqa: E402
    cuda_mem_tracker_run,
    cuda_offload_race,
    cuda_parity,
)
from tests.tools.track import cuda_tools_run  # noqa: E402

GIB = 2**30
H100_BYTES = 80 * 10**9  # an 80 GB H100 (what the scale points must fit)
STEP_TARGET, PEAK_TARGET = 0.95, 1.0  # issue 31: at most 0.95 of torch's step, its peak


def _timed(chunk: str, fn: Callable[[Runner], list[Row]]) -> Callable[[Runner], list[Row]]:
    def run(runner: Runner) -> list[Row]:
        started = time.monotonic()
        rows = fn(runner)
        spent = time.monotonic() - started
        for row in rows:
            row.chunk = chunk
            row.seconds = row.seconds or spent / len(rows)
        return rows

    return run


def _verdict(label: str, problems: list[str], figures: str) -> Row:
    status = "fail" if problems else "pass"
    return Row(chunk="", check=label, status=status, figures=figures, detail="\n".join(problems))


# --- parity and compile ------------------------------------------------------------------


def _parity(runner: Runner, cases: list[str]) -> list[Row]:
    cmd = runner.torchrun(
        runner.gpus, "tests/core/interop/cuda_parity.py", "--deterministic", *cases
    )
    records, error = runner.run("parity", cmd, timeout=540)
    rows = []
    for case in cases:
        found = [r for r in records if r["case"] == case]
        label = f"parity with torch: {case} (W={runner.gpus} NCCL, deterministic)"
        if not found:
            rows.append(Row(chunk="", check=label, status="error", detail=error))
            continue
        problems = cuda_parity.check(found)
        worst = max(r.get("max_param_diff", float("nan")) for r in found)
        figures = (
            "bit-identical"
            if all(r.get("identical") for r in found)
            else f"max shard diff {worst:.3g}"
        )
        rows.append(_verdict(label, problems, figures))
    return rows


def parity(runner: Runner) -> list[Row]:
    """fp32, bf16, offload, activation checkpointing, accumulation, no reshard."""
    return _parity(runner, ["fp32", "bf16", "offload", "checkpoint", "accumulate", "no-reshard"])


def compile_(runner: Runner) -> list[Row]:
    """Blocks compiled with inductor before sharding (torchtitan's order), fp32 and bf16."""
    return _parity(runner, ["compile", "compile-bf16"])


# --- CPU offload, repeated ---------------------------------------------------------------


def offload(runner: Runner) -> list[Row]:
    """217M, bf16 + pinned CPU offload, 8 AdamW steps: spread against torch's own; bit-identity."""
    rows = []
    for deterministic in (False, True):
        cmd = [sys.executable, "tests/core/interop/cuda_offload_race.py"]
        cmd += ["--deterministic"] if deterministic else []
        records, error = runner.run("offload", cmd, timeout=300)
        label = "CPU offload W=1: " + (
            "bit-identical, deterministic" if deterministic else "repeated runs vs torch's spread"
        )
        if not records:
            rows.append(Row(chunk="", check=label, status="error", detail=error))
            continue
        r = records[0]
        problems = cuda_offload_race.check(r)
        if deterministic:
            figures = (
                "bit-identical" if not problems else f"loss gap {r['shardkit_vs_torch_loss']:.3g}"
            )
        else:
            figures = (
                f"vs torch: loss {r['shardkit_vs_torch_loss']:.2g}, param "
                f"{r['shardkit_vs_torch_param']:.2g}; torch vs torch: loss "
                f"{r['torch_vs_torch_loss']:.2g}, param {r['torch_vs_torch_param']:.2g}"
            )
        rows.append(_verdict(label, problems, figures))
    return rows


# --- the trackers ------------------------------------------------------------------------


def _tracker_chunk(
    runner: Runner, name: str, script: str, label: str, module: Any, figures: Callable[..., str]
) -> list[Row]:
    """Run ``script`` on up to 2 GPUs; judge its records with ``module.check``."""
    nproc = min(2, runner.gpus)
    records, error = runner.run(name, runner.torchrun(nproc, script), timeout=300)
    label = f"{label} (W={nproc})"
    if error or not records:
        return [Row(chunk="", check=label, status="error", detail=error)]
    return [_verdict(label, module.check(records, nproc), figures(records))]


def tools(runner: Runner) -> list[Row]:
    """tests/tools/track/cuda_tools_run.py: the trackers on CUDA."""

    def figures(records: list[dict[str, Any]]) -> str:
        r = records[0]
        return (
            f"activations max {r['activations_max'] / 2**20:.1f} MiB, unsharded max "
            f"{r['unsharded_max'] / 2**20:.1f} MiB, peak in {r['peak_phase']}"
        )

    script = "tests/tools/track/cuda_tools_run.py"
    return _tracker_chunk(runner, "tools", script, "trackers on CUDA", cuda_tools_run, figures)


def mem_tracker(runner: Runner) -> list[Row]:
    """torch's FSDPMemTracker on both engines: its peak against the allocator's (torch's 10%)."""
    script = "tests/core/interop/cuda_mem_tracker_run.py"
    label = "torch's FSDPMemTracker, 4 MLPs fp16, peak vs the allocator's"
    module = cuda_mem_tracker_run
    return _tracker_chunk(runner, "mem-tracker", script, label, module, module.figures)


# --- step time and memory ----------------------------------------------------------------


def _compare(label: str, ours: dict[str, Any], theirs: dict[str, Any], peak_key: str) -> Row:
    step = ours["step_s"] / theirs["step_s"]
    peak = ours[peak_key] / theirs[peak_key]
    unit = GIB if peak_key.endswith("bytes") else 1024  # MiB figures: GiB shown
    figures = (
        f"step {ours['step_s']:.3f} s vs {theirs['step_s']:.3f} s: {step:.2f}x; "
        f"peak {ours[peak_key] / unit:.1f} vs {theirs[peak_key] / unit:.1f} GiB: {peak:.2f}x"
    )
    met = step <= STEP_TARGET and peak <= PEAK_TARGET
    return Row(chunk="", check=label, status="pass" if met else "miss", figures=figures)


def w1(runner: Runner) -> list[Row]:
    """Real NCCL at one GPU, each engine in its own process (shardkit: its one-rank path)."""
    rows = []
    for size, flags in (("217m", ["bf16"]), ("217m", [])):
        found: dict[str, dict[str, Any]] = {}
        errors = []
        for impl in ("torch", "shardkit"):
            cmd = runner.torchrun(1, "benchmarks/cuda_run.py", size, "20", impl, *flags)
            records, error = runner.run("w1", cmd, timeout=240)
            if records:
                found[impl] = records[0]
            errors.append(error)
        label = f"W=1 NCCL {size} {'bf16' if flags else 'fp32'} (shardkit runs no collective)"
        if len(found) < 2:
            rows.append(Row(chunk="", check=label, status="error", detail="\n".join(errors)))
        else:
            row = _compare(label, found["shardkit"], found["torch"], "peak_alloc_mib")
            # At W=1 the target is torch's time, not 0.95 of it.
            ratio = found["shardkit"]["step_s"] / found["torch"]["step_s"]
            peak = found["shardkit"]["peak_alloc_mib"] / found["torch"]["peak_alloc_mib"]
            row.status = "pass" if ratio <= 1.0 and peak <= PEAK_TARGET else "miss"
            rows.append(row)
    return rows


SCALE_POINTS = (("217m", 8), ("7.5b", 8), ("7.5b", 64), ("70b", 256))
FLOAT8_POINTS = (("217m", 1), ("217m", 8))


def _scale_label(size: str, world: int, float8: bool, device: str) -> str:
    how = "bf16 + Float8 all-gather (torchao)" if float8 else "bf16 + AC"
    return f"fake group W={world} {size}, {how} ({device})"


def _scale_row(
    size: str, world: int, found: dict[str, dict[str, Any]], runner: Runner, float8: bool = False
) -> Row:
    label = _scale_label(size, world, float8, runner.device)
    if float8 and not all(r.get("float8_linears") for r in found.values()):
        return Row(chunk="", check=label, status="error", detail="no Float8Linear in the model")
    key = "peak_alloc_bytes" if runner.device == "cuda" else "max_rss_bytes"
    row = _compare(label, found["shardkit"], found["torch"], key)
    if runner.device == "cuda":
        fits = max(r[key] for r in found.values()) <= H100_BYTES
        row.figures += "; fits an 80 GB H100" if fits else "; does NOT fit an 80 GB H100"
        retries = [found[impl].get("num_alloc_retries", 0) for impl in ("shardkit", "torch")]
        row.figures += f"; allocator retries {retries[0]} vs {retries[1]}"
        ours_asked = found["shardkit"].get("peak_requested_bytes")
        torchs_asked = found["torch"].get("peak_requested_bytes")
        held = found["shardkit"][key] - found["torch"][key]
        row.figures += f"; allocated peak {held / 1e6:+.1f} MB"  # what a 1.00x ratio hides
        if ours_asked is not None and torchs_asked is not None:
            # What the tensors asked for, the allocator's whole blocks left out.
            row.figures += f"; requested peak {(ours_asked - torchs_asked) / 1e6:+.1f} MB"
    else:
        # A CPU run checks that the code path works; its figures say little (one process
        # for all points: its peak RSS is theirs together).
        ours, theirs = found["shardkit"]["step_s"], found["torch"]["step_s"]
        row.figures = f"ran: step {ours:.3f} s vs torch's {theirs:.3f} s (the code path only)"
        row.status = "pass"
    return row


def _torchao_missing(runner: Runner, float8: bool) -> str:
    """'' if the point can run; else why not (Float8 needs torchao, which GPU images lack)."""
    if not float8:
        return ""
    probe = [sys.executable, "-c", "import torchao.float8"]
    _, error = runner.run("torchao-probe", probe, timeout=120)
    if error:
        return f"torchao does not import (make gpu-wheels puts its wheel in .whl/):\n{error}"
    return ""


def scale_point(size: str, world: int, float8: bool = False) -> Callable[[Runner], list[Row]]:
    """One fake-group point on the GPU: each engine in its own process (its own peak)."""

    def run(runner: Runner) -> list[Row]:
        label = _scale_label(size, world, float8, runner.device)
        missing = _torchao_missing(runner, float8)
        if missing:
            return [Row(chunk="", check=label, status="skip", detail=missing)]
        found: dict[str, dict[str, Any]] = {}
        errors = []
        flags = ["--device", "cuda", *(["--float8"] if float8 else [])]
        for impl in ("torch", "shardkit"):
            cmd = [sys.executable, "benchmarks/fake_scale.py", impl, size, str(world), *flags]
            records, error = runner.run(f"scale-{size}-w{world}", cmd, 280)
            if records:
                found[impl] = records[0]
            errors.append(error)
        if len(found) < 2:
            return [Row(chunk="", check=label, status="error", detail="\n".join(errors))]
        return [_scale_row(size, world, found, runner, float8)]

    return run


def scale_smoke(
    points: tuple[tuple[str, int], ...], float8: bool = False
) -> Callable[[Runner], list[Row]]:
    """The fake-group points on a CPU, all in one process: the code path, quickly."""

    def run(runner: Runner) -> list[Row]:
        missing = _torchao_missing(runner, float8)
        cmd = [sys.executable, "benchmarks/fake_scale.py", "--device", "cpu"]
        cmd += ["--steps", "2", "--warmup", "1", *(["--float8"] if float8 else [])]
        for size, world in points:
            cmd += ["torch", size, str(world), "shardkit", size, str(world)]
        label = "float8-smoke" if float8 else "scale-smoke"
        records, error = ([], missing) if missing else runner.run(label, cmd, timeout=300)
        rows = []
        for size, world in points:
            found = {r["impl"]: r for r in records if (r["size"], r["world"]) == (size, world)}
            if len(found) < 2:
                check = _scale_label(size, world, float8, "cpu")
                status = "skip" if missing else "error"
                rows.append(Row(chunk="", check=check, status=status, detail=error))
            else:
                rows.append(_scale_row(size, world, found, runner, float8))
        return rows

    return run


def reduce_precision(device: str, numels: tuple[int, ...]) -> Callable[[Runner], list[Row]]:
    """Issue 38: the compressed reduction's kernels beside NCCL's fp32 and bf16 reduce-scatters
    on one device, and the bytes each sends at W=64 (``benchmarks/cuda_reduce_precision.py``)."""

    def run(runner: Runner) -> list[Row]:
        args = ["--device", device, "--numels", *map(str, numels)]
        if device == "cpu":
            args += ["--iterations", "2"]
        cmd = runner.torchrun(1, "benchmarks/cuda_reduce_precision.py", *args)
        records, error = runner.run("reduce-precision", cmd, timeout=240)
        rows = []
        for numel in numels:
            found = {r["mode"]: r for r in records if r["numel"] == numel}
            label = f"reduce-precision {device} {numel:,} elements, W=1 (bytes at W=64)"
            if len(found) < 4:
                rows.append(Row(chunk="", check=label, status="error", detail=error))
                continue
            fp32 = found["nccl fp32 reduce-scatter"]
            cells = [
                f"{mode}: {r['ms']:.3f} ms, {r['sent_bytes_at_w'] / fp32['sent_bytes_at_w']:.3f}"
                " of fp32's bytes"
                for mode, r in found.items()
            ]
            rows.append(Row(chunk="", check=label, status="pass", figures="; ".join(cells)))
        return rows

    return run


def pytest_gpu(runner: Runner) -> list[Row]:
    """The pytest GPU tests themselves (the scripts above, through pytest's assertions)."""
    files = ["tests/core/interop/test_cuda.py", "tests/tools/track/test_cuda_tools.py"]
    files += ["tests/core/snapshots/test_memory_snapshots.py"]  # the staged copy on CUDA
    files += ["tests/core/snapshots/test_gradient_log.py"]  # the log's capture on CUDA
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    _, error = runner.run("pytest-gpu", cmd, timeout=600)
    status = "error" if error else "pass"
    return [Row(chunk="", check="pytest -m gpu " + " ".join(files), status=status, detail=error)]


class Chunk(NamedTuple):
    """A chunk's work, and about how many seconds it takes on one H100.

    From the first run (one H200, 2026-11-26), with room: a chunk is not started when its
    estimate exceeds the budget left, so an estimate far above the truth skips work.
    ``compile`` and the 70B point have not run yet: theirs are guesses.
    """

    run: Callable[[Runner], list[Row]]
    seconds: int
    default: bool = True
    """Run when no chunk is named (pytest-gpu is not: it repeats parity, offload and tools)."""


SMOKE_POINTS = (("fake-tiny", 8), ("fake-tiny", 64))
FLOAT8_SMOKE_POINTS = (("fake-tiny", 1), ("fake-tiny", 8))


def smoke_chunks() -> dict[str, Chunk]:
    """``--cpu-smoke``: the fake-group scale code on a CPU, with a tiny model."""
    float8 = scale_smoke(FLOAT8_SMOKE_POINTS, float8=True)
    precision = reduce_precision("cpu", (4096,))
    # With the gradient log: the same script, and the log's arguments and capture as well.
    snapshots = memory_snapshots("cpu", "fake-tiny", steps=3, rounds=2, gradient_log=True)
    muon_smoke = muon("cpu", "fake-tiny", (("fake-tiny", 1), ("fake-tiny", 8)), steps=2, rounds=2)
    return {
        "scale-smoke": Chunk(_timed("scale-smoke", scale_smoke(SMOKE_POINTS)), 60),
        "float8-smoke": Chunk(_timed("float8-smoke", float8), 60),
        "reduce-precision-smoke": Chunk(_timed("reduce-precision-smoke", precision), 30),
        "memory-snapshots-smoke": Chunk(_timed("memory-snapshots-smoke", snapshots), 40),
        "planner-smoke": Chunk(_timed("planner-smoke", planner("cpu", "fake-tiny", steps=2)), 20),
        "export-smoke": Chunk(_timed("export-smoke", export("cpu", "5m", syncs=3, rounds=2)), 60),
        "muon-smoke": Chunk(_timed("muon-smoke", muon_smoke), 40),
    }


def chunks(points: tuple[tuple[str, int], ...] = SCALE_POINTS) -> dict[str, Chunk]:
    """Every chunk, by name; ``points`` are the fake-group scale points (size, world)."""
    table = {
        "parity": Chunk(parity, 60),
        "compile": Chunk(compile_, 200),
        "offload": Chunk(offload, 120),
        "tools": Chunk(tools, 30),
        "mem-tracker": Chunk(mem_tracker, 60),
        "w1": Chunk(w1, 100),
    }
    estimates = {("217m", 8): 40, ("7.5b", 8): 60, ("7.5b", 64): 60, ("70b", 256): 240}
    for size, world in points:
        table[f"scale-{size}-w{world}"] = Chunk(
            scale_point(size, world), estimates.get((size, world), 30)
        )
    # Issue 31's Float8 point: its peak was 1.09 of torch's at W=1, 1.015 at W=8.
    for size, world in FLOAT8_POINTS:
        table[f"float8-{size}-w{world}"] = Chunk(scale_point(size, world, float8=True), 60)
    table["reduce-precision"] = Chunk(reduce_precision("cuda", (16 * 2**20, 64 * 2**20)), 30)
    # The default chunks, then 128 MiB ones (fewer times the copy's threads take the GIL).
    snapshots = memory_snapshots("cuda", "217m", steps=10, rounds=6, chunk_mib=(0, 128))
    table["memory-snapshots"] = Chunk(snapshots, 180)
    # The 2-core VM's benchmark (the demo GPT, W=2, each rank a node: the exchange over TCP)
    # on this machine's host cores, most of them idle, as on a GPU node.
    host = memory_snapshots("cpu", "demo", steps=8, rounds=8, judged=True)
    table["memory-snapshots-host"] = Chunk(host, 60)
    # The same with the gradient log between every 4th whole replica: fewer bytes exchanged.
    log = memory_snapshots("cpu", "demo", steps=8, rounds=8, judged=True, gradient_log=True)
    table["memory-snapshots-host-log"] = Chunk(log, 60)
    # Issue 65: the planner's peak and step time against the GPU's, default and chosen plans
    # (a guess: not run on a GPU yet; the search takes about 10 s on one core, the steps few).
    table["planner"] = Chunk(planner("cuda", "217m"), 90)
    # Issue 74: the weight export on NCCL, into the GPU and through both transports (a guess).
    table["export"] = Chunk(export("cuda", "150m", syncs=10, rounds=5), 90)
    # Issue 83: Muon's bits at one GPU, batching's, its step over AdamW's against the floor.
    table["muon"] = Chunk(muon("cuda", "217m", (("217m", 1), ("217m", 8))), 170)
    table["muon-7.5b-w64"] = Chunk(muon("cuda", "217m", (("7.5b", 64),), checks=False), 80)
    table["pytest-gpu"] = Chunk(pytest_gpu, 480, default=False)
    return {name: Chunk(_timed(name, c.run), c.seconds, c.default) for name, c in table.items()}
