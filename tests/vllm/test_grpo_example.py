"""demo/grpo_vllm.py, the GRPO loop of docs/guide/export.md, run as a user runs it: torchrun,
2 ranks, each with its vLLM engine and a shard of the trainer.

Two steps: the first sync is a full export, the second a delta. The example checks each sync
itself (the engine's weights read back against the trainer's) and, at the end, the synced
engine against a fresh one; here its exit status and summary are held to that, and its byte
counts to the model's size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _run_example(out: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "demo" / "grpo_vllm.py"),
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    # Two ranks on what may be a 2-core machine: one thread each, as `make check-vllm` runs.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _checkpoint_bytes(folder: Path) -> int:
    """The bytes of every tensor in the folder's safetensors (the bf16 model, as vLLM loads it)."""
    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as opened:
        names: list[str] = list(opened.keys())
        for name in names:
            tensor = opened.get_tensor(name)
            total += tensor.numel() * tensor.element_size()
    return total


def test_the_grpo_example_syncs_its_engines_bit_for_bit(tmp_path: Path) -> None:
    result = _run_example(tmp_path)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert "bit-identical" in result.stdout, tail

    summary: dict[str, Any] = json.loads((tmp_path / "summary.json").read_text())
    steps: list[dict[str, Any]] = summary["steps"]
    assert summary["world_size"] == 2
    assert [s["kind"] for s in steps] == ["full"] + ["delta"] * (STEPS - 1)

    for s in steps:
        assert math.isfinite(s["loss"]), s
        assert 0.0 <= s["mean_reward"] <= 1.0, s
        # Read back from the engine after the sync: every weight equal to the trainer's.
        assert s["engine_equals_trainer"], s
        # Training moved some bf16 values, so the check compared changed weights.
        assert s["elements_changed"] > 0, s
        assert s["export_s_slowest"] > 0.0, s

    # A full export sends every element once, in bf16: the ranks' shards add up to the model.
    full, *deltas = steps
    assert full["sent_bytes_all_ranks"] == _checkpoint_bytes(tmp_path / "initial")
    # A delta is never larger. This tiny model's step at lr 1e-5 changes 10 to 15% of the
    # elements, past the 1/8 where a bucket goes plain (cheaper than its changes), so a delta
    # may send as much as a full export here.
    for delta in deltas:
        assert 0 < delta["sent_bytes_all_ranks"] <= full["sent_bytes_all_ranks"], delta

    check = summary["bit_identity"]
    assert check["greedy_equal"], check
    assert check["mirror_equal"], check
    assert check["greedy_moved"], check
    assert check["passed"] and summary["passed"], summary
