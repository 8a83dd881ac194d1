"""Every GPU test and benchmark of shardkit, and one table of what they found: `make check-gpu`.

    python scripts/check_gpu.py                    every chunk, one after another
    python scripts/check_gpu.py --chunks parity,tools  some (a prefix picks several: "scale")
    python scripts/check_gpu.py --list             the chunks and their time on one H100
    python scripts/check_gpu.py --table DIR...     one table from results saved earlier
    python scripts/check_gpu.py --cpu-smoke        the fake-group points on a CPU, tiny model

The chunks (scripts/gpu_chunks.py): deterministic parity with torch's fully_shard on NCCL at
the GPUs present (fp32, bf16, CPU offload, activation checkpointing, accumulation, no reshard;
compiled blocks), CPU offload's repeated runs against torch's own spread, the trackers on CUDA
(shardkit's; torch's FSDPMemTracker against the allocator's peak, on both engines), W=1 step
time and memory (each engine in its own process), and the fake-group scale points
(217M at W=8, 7.5B at W=8 and 64, 70B at W=256; one point per process, meta-device init),
memory snapshots' step time (issue 40: a snapshot every step, at most 1.05 of the step;
scripts/gpu_snapshot_chunk.py), and the planner's predicted peak and step time against the
GPU's for the 217M GPT's default and chosen plans (issue 65; scripts/gpu_planner_chunk.py),
the weight export (issue 74; scripts/gpu_export_chunk.py), and Muon's bits, step and peak
(issue 83; scripts/gpu_muon_chunk.py).

``--budget`` (default 540 s, for a machine that runs one command 600 s at most) bounds one
invocation: a chunk that would not finish in what is left is not started, and the table says
so. Results go to ``$OUT/gpu-check/`` (else ``.gpu-check/``): ``results.json`` and
``table.md``, rewritten after every chunk. ``CHECK_GPU_CHUNKS`` is ``--chunks`` from the
environment. Needs CUDA, except ``--list``, ``--table`` and ``--cpu-smoke``. Where shardkit is
not installed, the wheels in ``.whl/`` (``make gpu-wheels`` builds them) are installed with
``pip install --no-deps --target .gpu-site``: the GPU machine needs no hatchling, no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SITE = ROOT / ".gpu-site"


def _probe(env: MutableMapping[str, str]) -> str:
    """'' if shardkit imports in a child with ``env``, else the error's last lines."""
    code = "import shardkit.core, shardkit.tools"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stderr.strip()[-1500:]


def ensure_shardkit(env: MutableMapping[str, str]) -> str:
    """Make shardkit importable here and in children with ``env``; '' or why it cannot be."""
    try:
        # Found here through site-packages or PYTHONPATH, it is found by children too.
        import shardkit.core
        import shardkit.tools  # noqa: F401
    except ImportError:
        pass
    else:
        return ""
    error = _probe(env)
    if not error:
        return ""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return f"shardkit does not import, and .whl/ holds no wheels (make gpu-wheels):\n{error}"
    # Installed again whenever the wheels differ from those installed (a later `make gpu-wheels`).
    stamp = "\n".join(f"{w.name} {hashlib.sha256(w.read_bytes()).hexdigest()}" for w in wheels)
    if not (SITE / ".wheels").exists() or (SITE / ".wheels").read_text() != stamp:
        shutil.rmtree(SITE, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        pip += ["--target", str(SITE), *map(str, wheels)]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0 and "No module named pip" in done.stderr:
            # No pip: pure-Python wheels unpack into a site folder as pip would lay them out.
            for wheel in wheels:
                zipfile.ZipFile(wheel).extractall(SITE)
        elif done.returncode != 0:
            return f"pip could not install .whl/:\n{done.stderr[-1500:]}"
        (SITE / ".wheels").write_text(stamp)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(SITE))
    error = _probe(env)
    if error:
        import torch

        return (
            f"shardkit (installed from .whl/) does not import on torch {torch.__version__}; "
            f"until it does (issue 25: names it needs from torch 2.13), nothing can run:\n{error}"
        )
    return ""


def select(names: list[str], known: list[str]) -> list[str]:
    """The chunks ``names`` pick, in order: a name, or a prefix of several ("scale")."""
    chosen: list[str] = []
    for name in names:
        found = [k for k in known if k == name] or [k for k in known if k.startswith(name)]
        if not found:
            raise SystemExit(f"unknown chunk {name!r}; known: {', '.join(known)}")
        chosen += [k for k in found if k not in chosen]
    return chosen


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, then what went wrong in each row that says."""
    lines = ["| chunk | check | result | figures | s |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r["chunk"], r["check"], r["status"].upper(), r["figures"], f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["detail"]:
            lines += ["", f"{r['chunk']} / {r['check']}:", "```", r["detail"].strip(), "```"]
    return "\n".join(lines)


def _out_dir() -> Path:
    out = os.environ.get("OUT")
    folder = Path(out) / "gpu-check" if out else ROOT / ".gpu-check"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _meta(device: str) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if device == "cuda":
        meta.update(
            gpu=torch.cuda.get_device_name(),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return meta


def run_chunks(names: list[str], *, budget: float, device: str, smoke: bool = False) -> int:
    """Run the chunks ``names`` and print the table; the exit status (1: a check failed)."""
    import torch
    from scripts import gpu_chunks, gpu_runner

    known = gpu_chunks.smoke_chunks() if smoke else gpu_chunks.chunks()
    gpus = torch.cuda.device_count() if device == "cuda" else 1
    runner = gpu_runner.Runner(
        env=os.environ.copy(), deadline=time.monotonic() + budget, gpus=gpus, device=device
    )
    folder, meta = _out_dir(), _meta(device)
    rows: list[dict[str, Any]] = []
    for name in names:
        chunk = known[name]
        if runner.left() < chunk.seconds:
            why = f"not started: about {chunk.seconds} s needed, {runner.left():.0f} s left"
            skipped = gpu_runner.Row(chunk=name, check="-", status="skip", detail=why)
            rows.append(gpu_runner.row_dict(skipped))
        else:
            print(f"[check_gpu] {name} (about {chunk.seconds} s)", flush=True)
            rows += [gpu_runner.row_dict(row) for row in chunk.run(runner)]
        results = {"meta": meta, "rows": rows, "records": runner.records}
        results["crashes_retried"] = runner.crashes_retried
        (folder / "results.json").write_text(json.dumps(results, indent=1))
        (folder / "table.md").write_text(table(rows) + "\n")
    print(f"\n{meta}\n\n{table(rows)}\n\nresults: {folder}")
    for crash in runner.crashes_retried:
        print(f"\nkilled by a crash signal, then run again:\n{crash}")
    return 1 if any(r["status"] in ("fail", "error") for r in rows) else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default=os.environ.get("CHECK_GPU_CHUNKS", ""))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all chunks")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--table", nargs="+", metavar="DIR", type=Path)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.table:
        found = [json.loads((d / "results.json").read_text()) for d in args.table]
        print("\n".join(str(f["meta"]) for f in found) + "\n")
        print(table([row for f in found for row in f["rows"]]))
        return 0
    import torch

    if not (args.list or args.cpu_smoke or torch.cuda.is_available()):
        print(
            "check_gpu: no CUDA device here, and every check needs one "
            "(--cpu-smoke runs the fake-group points on a CPU)",
            file=sys.stderr,
        )
        return 2
    env_error = ensure_shardkit(os.environ)  # children inherit what it sets
    if env_error:
        print(f"check_gpu: {env_error}", file=sys.stderr)
        return 2
    from scripts import gpu_chunks

    if args.list:
        for name, chunk in gpu_chunks.chunks().items():
            note = "" if chunk.default else " (only when named)"
            print(f"{name:18} about {chunk.seconds:4d} s on one H100{note}")
        return 0
    if args.cpu_smoke:
        smoke = list(gpu_chunks.smoke_chunks())
        return run_chunks(smoke, budget=args.budget, device="cpu", smoke=True)
    known = gpu_chunks.chunks()
    if args.chunks:
        names = select([n for n in args.chunks.split(",") if n], list(known))
    else:
        names = [name for name, chunk in known.items() if chunk.default]
    return run_chunks(names, budget=args.budget, device="cuda")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
