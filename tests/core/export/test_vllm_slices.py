"""VLLMSliceReceiver's checks before it writes (no vLLM: a stand-in ``vllm.LLM`` whose worker
is called in this process, as ``external_launcher`` runs it).

An engine whose worker runs in another process is refused in ``begin``; a bucket of another
engine rank's windows, or a dtype other than the engine's, is refused with nothing loaded;
what loads reaches the worker as ``WindowedWeight`` of the full shape. All or nothing (the
default): buckets are staged on the worker and loaded at the commit, which is undone on every
engine rank when the export fails anywhere (W=2 through the ``SlicedExporter``, one stand-in
engine rank per trainer rank, one of them failing its commit).
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
from tests.core.export.slice_engines import StandInTPEngine

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
    receiver = VLLMSliceReceiver(engine, all_or_nothing=False)
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


def _export(receiver: VLLMSliceReceiver, export_id: int, values: torch.Tensor) -> None:
    tp = EngineTP(degree=2, num_heads=2, num_kv_heads=2, head_dim=2, vocab_size=64)
    window = engine_window(tp, NAME, (8, 4), 1)
    receiver.begin(
        ExportManifest(export_id, "full", (ExportedTensor(NAME, (8, 4), torch.bfloat16, 0),), 1)
    )
    receiver.receive(SlicedBucket(0, 1, 2, ((window, values),)))


def test_all_or_nothing_stages_then_loads_at_the_commit_and_undoes_it_on_abort() -> None:
    engine = StandInTPEngine(rank=1)
    receiver = VLLMSliceReceiver(engine)
    first = torch.full((4, 4), 1.0, dtype=torch.bfloat16)
    _export(receiver, 0, first)
    assert engine.model.held() == {}, "nothing loaded before the commit"
    receiver.commit()
    receiver.finish()
    assert receiver.version == 0 and torch.equal(engine.model.held()[NAME], first)
    # Export 1 commits here, then another rank fails: abort puts export 0 back.
    _export(receiver, 1, torch.full((4, 4), 2.0, dtype=torch.bfloat16))
    receiver.commit()
    assert engine.model.held()[NAME][0, 0] == 2.0
    receiver.abort(RuntimeError("rank 0 failed its commit"))
    assert receiver.version == 0 and torch.equal(engine.model.held()[NAME], first)
    # A load that raises partway at the commit: put back at once, and the error says so.
    engine.model.fail = True
    _export(receiver, 2, torch.full((4, 4), 3.0, dtype=torch.bfloat16))
    with pytest.raises(WeightLoadError, match=r"export 2 failed at its commit.*put back"):
        receiver.commit()
    receiver.abort(RuntimeError("its own commit"))
    assert receiver.version == 0 and torch.equal(engine.model.held()[NAME], first)


def _two_engine_ranks(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard
    from shardkit.core.errors import WeightExportError
    from shardkit.core.export.tp_export import SlicedExporter
    from shardkit.core.export.tp_slices import SliceKind
    from tests.core.export.export_models import Decoder, perturb

    torch.manual_seed(0)
    model: Any = Decoder()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tp = EngineTP(degree=2, num_heads=4, num_kv_heads=4, head_dim=6, vocab_size=61,
                  kinds={"model.position_scale": SliceKind.WHOLE})  # fmt: skip
    exporter = SlicedExporter(model, tp, dtype=torch.bfloat16, bucket_bytes=3000, bound_s=30)
    engine = StandInTPEngine(rank=rank)
    receiver = VLLMSliceReceiver(engine)

    def expected() -> dict[str, torch.Tensor]:
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).to(torch.bfloat16)
            for k, v in model.state_dict().items()
        }
        cut = {}
        for source in (s for b in exporter.buckets for s in b.sources):
            whole = full[source.name]
            box = engine_window(tp, source.name, tuple(whole.shape), rank).box
            cut[source.name] = whole[tuple(slice(a, b) for a, b in box)]
        return cut

    def same(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
        return held.keys() == want.keys() and all(torch.equal(held[k], want[k]) for k in want)

    exporter.export(receiver)
    first = expected()
    out: dict[str, Any] = {"first": same(engine.model.held(), first), "v0": receiver.version}
    perturb(model, 1)
    engine.model.fail = rank == 1  # rank 1's commit raises after a first write
    try:
        exporter.export(receiver)
        out["error"] = "no error"
    except WeightExportError as error:
        out["error"] = str(error)
    out["kept"] = same(engine.model.held(), first)
    out["v1"] = receiver.version
    engine.model.fail = False
    exporter.export(receiver)
    out["after"] = same(engine.model.held(), expected())
    out["v2"] = receiver.version
    return out


def test_a_commit_failing_on_one_engine_rank_is_undone_on_every_rank() -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(2, _two_engine_ranks)
    (message,) = {r["error"] for r in results}
    assert "commit" in message and "the stand-in's load raised" in message, message
    for r in results:
        assert r["first"] and r["v0"] == 0, r
        # Rank 0's commit went through, rank 1's raised: both serve export 0, complete.
        assert r["kept"] and r["v1"] == 0, r
        assert r["after"] and r["v2"] == 2, r
