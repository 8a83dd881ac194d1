"""trl 1.16's GRPOTrainer syncing its colocated vLLM engines through the export, at W=2.

tests/vllm/trl_grpo_run.py, run as a user runs a trl script: torchrun, 2 ranks, gloo, CPU.
The trainer's model is sharded by accelerate's FSDP2 (torch's ``fully_shard`` per decoder
layer); ``sync_through_export`` replaces trl's per-parameter sync; 3 training steps. Every
sync is checked on every rank: each tensor read back from that rank's engine equals the
trainer's ``full_tensor()`` in the engine's dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def test_trls_grpo_trainer_syncs_through_the_export_bit_for_bit(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "tests.vllm.trl_grpo_run", str(tmp_path), str(STEPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(found["losses"]) == STEPS
        assert "FSDPQwen2DecoderLayer" in found["fsdp_modules"]  # sharded by accelerate's FSDP2
        checks = found["checks"]
        # A sync before the first step's generation, then one after each optimizer step but
        # the last (trl syncs when it next generates).
        assert len(checks) == STEPS
        assert [c["kind"] for c in checks] == ["full", "delta", "delta"]
        for step, check in enumerate(checks):
            assert check["tensors"] == 27 and not check["missing"], (step, check)
            assert not check["differ"], f"rank {rank}, sync {step}: {check['differ']}"
        for delta in checks[1:]:  # changes, not the whole bucket
            assert delta["plain_buckets"] == 0 and 0 < delta["sent_bytes"] < checks[0]["sent_bytes"]
