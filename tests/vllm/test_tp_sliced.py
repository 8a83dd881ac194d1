"""A TP-sliced export into vLLM's CPU build running tensor-parallel: a trainer at W=2
(``fully_shard``) and a colocated engine of ``tensor_parallel_size=2`` (``external_launcher``),
each process one engine rank, each receiving only its windows (tp_sliced_run.py).

The oracle is a fresh TP=2 engine started from the trainer's weights: after the sync the
engine's greedy tokens and log-probabilities equal it, and so does every parameter of each
engine rank, read back (fused q/k/v and gate/up, the vocab partitions with their padding).
A third export that fails at rank 1's commit leaves both engine ranks serving the second,
complete: rank 0's commit, which went through, is undone (all or nothing). At W=4 the trainer
feeds two such engines in its four processes (vLLM's data parallel over the launcher's ranks,
as verl's hybrid engine runs them): rank ``i`` is engine rank ``i % 2`` of engine ``i // 2``,
and the refusal at rank 1 leaves all four engine ranks serving the second export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("tp_sliced_run.py")
# vLLM's CPU build names the TP group's shared memory after the group alone: a TP=2 engine
# killed before it ends leaves these behind, and the next one fails to create them (errno 17).
STALE = [
    Path("/dev/shm") / f"-tp:0-[{group}]-cpushm_{rank}"
    for group in ("0-1", "2-3")
    for rank in (0, 1)
]


def _phase(out: Path, phase: str, world: int) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(SCRIPT),
        "--out",
        str(out),
        "--phase",
        phase,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize("world", [2, 4], ids=["one-engine", "two-engines"])
def test_a_tp2_engine_takes_its_slices_bit_for_bit(tmp_path: Path, world: int) -> None:
    stale = [str(p) for p in STALE if p.exists()]
    assert not stale, f"a TP=2 vLLM engine left its shared memory behind (remove it): {stale}"
    for phase in ("sync", "fresh"):
        result = _phase(tmp_path, phase, world)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    for rank in range(world):
        synced = json.loads((tmp_path / f"synced_outputs_{rank}.json").read_text())
        fresh = json.loads((tmp_path / f"fresh_outputs_{rank}.json").read_text())
        assert synced == fresh  # tokens and top-5 log-probabilities, every step
        ours = load_file(str(tmp_path / f"synced_params_{rank}.safetensors"))
        theirs = load_file(str(tmp_path / f"fresh_params_{rank}.safetensors"))
        assert sorted(ours) == sorted(theirs)
        assert any("qkv_proj" in name for name in ours)
        assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == []

    summary: list[dict[str, Any]] = json.loads((tmp_path / "summary.json").read_text())
    for rank, entry in enumerate(summary):
        assert entry["outputs_changed"]  # the engine started from other weights
        # After a second sync (the trainer's weights moved), each engine rank holds them.
        assert entry["windows_wrong_first"] == [] and entry["windows_wrong_second"] == []
        # The third export failed at rank 1's commit: every rank raised one error, and both
        # engine ranks serve the second export, complete (rank 0's commit undone).
        assert "rank 1's commit refused (injected)" in entry["third_error"], entry["third_error"]
        assert entry["windows_wrong_after_failure"] == [], entry["windows_wrong_after_failure"]
        assert entry["served_as_second_after_failure"]
        assert entry["versions"][0] == 1 and entry["versions"][1] in (1, None), entry["versions"]
        window, received, copied, _ = entry["counts"][rank]
        assert window == received + copied == entry["second_window_bytes"]
        # Each engine rank holds part of the model, never all of it (norms and the one
        # kv head, replicated on both ranks, are the part above one half).
        assert entry["model_bytes"] / 2 < window < entry["model_bytes"]
    counts = summary[0]["counts"]
    assert sum(c[3] for c in counts) == sum(c[1] for c in counts)  # sent = received
