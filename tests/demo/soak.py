"""What the soak tests share: the kill points of `make soak`, and the check against the run
that was never killed (tests/demo/test_demo_soak.py, tests/demo/test_demo_snapshot_soak.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.demo.rig import KillPoint

__all__ = ["EVERY", "KILLS", "SMALL", "STEPS", "Resumed", "check_against_reference", "kill_points"]

STEPS, EVERY, KILLS = 300, 10, 5
SMALL = ["--d-model=64", "--n-layers=2", "--seq-len=32", "--log-every=10"]


def kill_points(seed: int) -> list[KillPoint]:
    """Five kills at steps at least 2 checkpoints apart; saves are killed at save steps."""
    rng = random.Random(seed)
    phases = ["forward", "backward", "save", "async-save"]
    phases.append(rng.choice(phases))
    rng.shuffle(phases)
    slots = rng.sample(range(3, STEPS // EVERY - 1), KILLS * 3)  # checkpoint intervals
    chosen: list[int] = []
    for slot in slots:  # intervals at least two apart, so each kill's losses are its own
        if all(abs(slot - c) >= 2 for c in chosen) and len(chosen) < KILLS:
            chosen.append(slot)
    kills = []
    for slot, phase in zip(sorted(chosen), phases, strict=True):
        offset = 0 if phase in ("save", "async-save") else rng.randrange(1, EVERY)
        kills.append(KillPoint(rng.randrange(2), slot * EVERY + offset, phase))
    return kills


def _records(metrics: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@dataclass(frozen=True, slots=True)
class Resumed:
    """A restart: the last step logged before it, the step it resumed from, and from where."""

    done: int
    step: int
    path: str
    seconds: float = 0.0  # the restore itself, as the demo logs it


def check_against_reference(reference: Path, metrics: Path, ref: Path, run: Path) -> list[Resumed]:
    """Every loss of ``metrics`` (recomputed ones too) and the model exported under ``run``
    equal the uninterrupted run's, bit for bit; the restarts, in order."""
    want = {int(r["step"]): r["loss"] for r in _records(reference) if "loss" in r}  # type: ignore[call-overload]
    last_done, resumes = 0, []
    for record in _records(metrics):
        if "loss" in record:
            step = int(record["step"])  # type: ignore[call-overload]
            assert record["loss"] == want[step], f"step {step} differs after a restart"
            last_done = max(last_done, step)
        elif record.get("event") == "resumed":
            resumed = int(record["step"])  # type: ignore[call-overload]
            seconds = float(record.get("seconds", 0.0))  # type: ignore[arg-type]
            resumes.append(Resumed(last_done, resumed, str(record["path"]), seconds))
    got = {int(r["step"]): r["loss"] for r in _records(metrics) if "loss" in r}  # type: ignore[call-overload]
    assert got == want  # the final curve, every step
    exported = load_file(run / "model.safetensors")
    expected = load_file(ref / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    return resumes
