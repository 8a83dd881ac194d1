"""The demo past one machine: two torchrun "nodes" of 2 ranks (fixed node ranks, the master on
localhost) train with HSDP (sharded within a node, replicated across nodes), checkpoint, and
compute the losses of torch's fully_shard on the same layout bit for bit, and those of 4 ranks
training with plain FSDP on the same global batch. The two references run the demo's own
training function on the test pool's 4 ranks (the same mesh, ranks 0-1 and 2-3 the "nodes";
tests/demo/in_pool.py), which saves two 4-rank torchrun launches.

HSDP sums gradients within a node, then across nodes, and reduces the gradient norm per mesh
axis, so the losses may differ from plain FSDP's in the last bits; 1e-5 relative is far
below the change of the loss in a step (about 1e-2 here). Step 1 runs the same forward on
the same weights and rows, so its loss is equal bit for bit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from demo.run_demo import REPO, TRAIN_SCRIPT, launch_lines

from tests.demo.in_pool import losses, train_in_pool

SMALL = ["--d-model=64", "--n-layers=2", "--seq-len=32", "--batch-size=4", "--steps=4"]


def _train(name: str, nodes: int, tmp_path: Path, extra: list[str]) -> tuple[dict[int, float], str]:
    """Run one job on `nodes` launches of 4 / nodes ranks; its losses and rank 0's output."""
    metrics = tmp_path / f"{name}.jsonl"
    script = [str(TRAIN_SCRIPT), *SMALL, f"--metrics-file={metrics}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launches = [
        subprocess.Popen(
            [*line, *script],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in launch_lines(nodes, 4 // nodes)
    ]
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    for launch, output in zip(launches, outputs, strict=True):
        assert launch.returncode == 0, output[-3000:]
    return losses(metrics), "\n".join(outputs)


def test_two_nodes_train_with_hsdp_as_one_node_trains_with_fsdp(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    two, two_output = _train("hsdp", 2, tmp_path, [f"--ckpt-dir={ckpt}", "--ckpt-every=2"])
    torch_args = [*SMALL, "--impl=torch", "--replicas=2"]
    torch_two, torch_output = train_in_pool(torch_args, tmp_path / "torch_hsdp.jsonl")
    one, one_output = train_in_pool([*SMALL, "--replicas=1"], tmp_path / "fsdp.jsonl")
    assert two == torch_two  # torch's fully_shard on the same mesh: bit for bit
    # The runs are what they claim: HSDP across the launches, plain FSDP on one.
    assert "ranks=4 (dp_replicate 2 x dp_shard 2)" in two_output
    assert "impl=torch ranks=4 (dp_replicate 2 x dp_shard 2)" in torch_output
    assert "ranks=4 (dp 4)" in one_output
    assert list(two) == list(one) == [1, 2, 3, 4]
    assert two[1] == one[1]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5, abs=0.0), step
    assert two[4] < two[1] - 0.05  # it trains
    # The HSDP job saved through DCP and exported the full model, from both nodes' ranks.
    assert (ckpt / "model.safetensors").is_file()
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000004"]
