"""VLLMSliceReceiver's checks before it writes (no vLLM: a stand-in ``vllm.LLM`` whose worker
is called in this process, as ``external_launcher`` runs it).

An engine whose worker runs in another process is refused in ``begin``; a bucket of another
engine rank's windows, or a dtype other than the engine's, is refused with nothing loaded;
what loads reaches the worker as ``WindowedWeight`` of the full shape.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export import ExportedTensor, ExportManifest
from shardkit.core.export.tp_export import SlicedBucket
from shardkit.core.export.tp_slices import EngineTP, engine_window
from shardkit.core.export.vllm_slices import VLLMSliceReceiver, tp_place_of_worker
from shardkit.core.export.vllm_worker import load_on_worker, probe_worker
from shardkit.core.export.windowed_weight import WindowedWeight

NAME = "model.layers.0.mlp.up_proj.weight"


class StandInEngine:
    """A ``vllm.LLM`` with its engine core in this process and one worker, engine rank 1 of 2."""

    def __init__(self, *, worker_pid: int) -> None:
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.bfloat16),
            vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()),
            model_executor=object(),  # vLLM sets it where the engine core is in-process
        )
        self.worker_pid = worker_pid
        self.loaded: list[tuple[str, Any]] = []

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        if method is probe_worker:
            return [("reload_weights", "bfloat16", "a stand-in", self.worker_pid)]
        if method is tp_place_of_worker:
            return [(1, 2)]
        assert method is load_on_worker
        self.loaded += args[1]
        return [None]


def _manifest(dtype: torch.dtype = torch.bfloat16) -> ExportManifest:
    return ExportManifest(0, "full", (ExportedTensor(NAME, (8, 4), dtype, 0),), 1)


def _bucket(engine_rank: int) -> SlicedBucket:
    tp = EngineTP(degree=2, num_heads=2, num_kv_heads=2, head_dim=2, vocab_size=64)
    window = engine_window(tp, NAME, (8, 4), engine_rank)
    data = torch.arange(16, dtype=torch.bfloat16).view(4, 4)
    return SlicedBucket(0, engine_rank, 2, ((window, data),))


def test_a_worker_in_another_process_is_refused_before_anything_is_sent() -> None:
    engine = StandInEngine(worker_pid=os.getpid() + 1)
    with pytest.raises(WeightExportError, match=r"external_launcher.*nothing was written"):
        VLLMSliceReceiver(engine).begin(_manifest())
    assert engine.loaded == []


def test_another_engine_ranks_windows_and_another_dtype_are_refused() -> None:
    engine = StandInEngine(worker_pid=os.getpid())
    receiver = VLLMSliceReceiver(engine)
    with pytest.raises(WeightLoadError, match=re.escape("sent as torch.float32")):
        receiver.begin(_manifest(torch.float32))
    receiver.begin(_manifest())
    with pytest.raises(WeightLoadError, match=r"windows of engine rank 0 of TP degree 2.*rank 1"):
        receiver.receive(_bucket(0))
    assert engine.loaded == []
    receiver.receive(_bucket(1))
    ((name, tensor),) = engine.loaded
    assert name == NAME and isinstance(tensor, WindowedWeight)
    assert tuple(tensor.shape) == (8, 4) and torch.equal(
        tensor.narrow(0, 4, 4), _bucket(1).windows[0][1]
    )
    assert receiver.loaded == [NAME]
