"""transformers' native FSDP2 path (``from_pretrained(..., distributed_config=...)``) on shardkit.

transformers 5 shards a model itself while it reads the checkpoint (``apply_fully_sharded_data_
parallelism`` calls ``fully_shard`` per decoder layer, ``fully_shard([norm, lm_head])`` and the
root), and ``save_pretrained`` gathers it or writes DCP shards. This is a call site of
``fully_shard`` beside Accelerate's, and the program here is what its users run: launched by
``torchrun`` on torch's engine, and by ``torchrun -m shardkit.core.run`` on shardkit's, with no
edit. Same losses; the gathered checkpoint byte for byte torch's, the DCP shards the same
tensors, offsets and metadata; shardkit reads the
DCP checkpoint torch's run wrote back into the same values.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.interop.hf_models import tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers.distributed") is None,
    reason="transformers with native distributed support (5.x) is not installed",
)

_ROOT = Path(__file__).resolve().parents[3]
_PROGRAM = Path(__file__).with_name("hf_native_program.py")
_DCP_FILES = (
    "dcp/shard-00001-model-00001-of-00001.safetensors",
    "dcp/shard-00002-model-00001-of-00001.safetensors",
)


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header: each tensor's dtype, shape and offsets, and the
    metadata (DCP's sharding info there)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header: dict[str, Any] = json.loads(data[8 : 8 + size])
    return header


def _save_source(path: Path) -> None:
    """A tiny Llama checkpoint, made here (no download)."""
    tiny_llama().save_pretrained(path)


def _launch(engine: str, src: Path, out: Path, *extra: str) -> dict[str, Any]:
    launcher = ["-m", "shardkit.core.run"] if engine == "shardkit" else []
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        *launcher, str(_PROGRAM), str(src), str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def test_native_fsdp2_trains_and_saves_as_torch(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = tmp_path / "src"
    _save_source(src)
    theirs = _launch("torch", src, tmp_path / "torch")
    ours = _launch("shardkit", src, tmp_path / "shardkit", "--reload", str(tmp_path / "torch/dcp"))
    assert theirs["engine"].startswith("torch.distributed.fsdp")
    assert ours["engine"] == "shardkit.core.api"  # transformers' fully_shard calls were ours
    assert ours["losses"] == theirs["losses"]
    gathered = "full/model.safetensors"
    ours_file, theirs_file = tmp_path / "shardkit", tmp_path / "torch"
    assert (ours_file / gathered).read_bytes() == (theirs_file / gathered).read_bytes()
    # DCP's per-rank files: torch writes their metadata's keys in an order that varies from
    # run to run (torch's own two runs differ there), so the header is compared parsed.
    for name in _DCP_FILES:
        assert _header(ours_file / name) == _header(theirs_file / name), name
        ours_tensors, theirs_tensors = load_file(ours_file / name), load_file(theirs_file / name)
        assert ours_tensors.keys() == theirs_tensors.keys() and len(ours_tensors) == 21
        for key, value in theirs_tensors.items():
            assert torch.equal(ours_tensors[key], value), (name, key)
    # torch's DCP checkpoint, read by shardkit's run: the values torch's run had saved.
    reloaded = load_file(tmp_path / "shardkit/reloaded/model.safetensors")
    final = load_file(tmp_path / "torch/full/model.safetensors")
    assert reloaded.keys() == final.keys() and len(final) == 21
    for key, value in final.items():
        assert torch.equal(reloaded[key], value), key
    start = load_file(src / "model.safetensors")
    assert not torch.equal(start["lm_head.weight"], final["lm_head.weight"])  # it trained
