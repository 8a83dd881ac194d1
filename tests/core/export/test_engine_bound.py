"""An engine in another process never hangs the export (no vLLM: a stand-in ``vllm.LLM``).

The stand-in looks like vLLM's ``LLM`` with its engine core in a process of its own (no
``model_executor`` on its engine) and answers ``collective_rpc`` as told: by method name only
(what vLLM does without ``VLLM_ALLOW_INSECURE_SERIALIZATION``), or never (its input thread
dead). An engine with no route to its worker is refused before the first bucket, naming the
settings; one that stops answering ends the export on every rank within the bound.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core.errors import WeightExportError
from shardkit.core.export import ExportedTensor, ExportManifest, WeightBucket
from shardkit.core.export.vllm import VLLMReceiver
from shardkit.core.export.vllm_rpc import bounded
from shardkit.core.export.vllm_worker import EXTENSION
from tests.core.export.export_models import sharded


class StandInEngine:
    """A ``vllm.LLM`` whose engine core runs elsewhere; answers ``answers`` calls, then none.

    Functions are refused as vLLM refuses a pickled one without the setting (here at once;
    vLLM's own client would wait for ever, which ``answers`` stands for).
    """

    def __init__(self, *, extension: str = EXTENSION, answers: int = 10**6) -> None:
        parallel = SimpleNamespace(worker_extension_cls=extension)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.bfloat16, model="not-a-folder"),
            vllm_config=SimpleNamespace(parallel_config=parallel),
        )
        self.answers = answers
        self.release = threading.Event()  # lets a stuck call go once the test is over
        self.calls: list[str] = []
        self.loaded: list[bytes] = []
        self.serving: int | None = None
        self.refuse_commit = False

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        if not isinstance(method, str):
            raise TypeError("Extension type code 2 is not supported")
        self.calls.append(method)
        if len(self.calls) > self.answers:
            self.release.wait()  # a dead input thread: no answer comes
            raise RuntimeError("released")
        if method == "shardkit_probe":
            return [["reload_weights", "bfloat16", "a stand-in", -1]]  # a list, as over RPC
        if method == "shardkit_commit":
            if self.refuse_commit:
                raise RuntimeError("vLLM's reload_weights raised: the model was put back")
            self.serving = args[0]
            return [args[0]]
        if method == "shardkit_serving_version":
            return [self.serving]
        self.loaded.append(args[1])
        return [None]

    def reset_prefix_cache(self) -> bool:
        return True


def _manifest() -> tuple[ExportManifest, WeightBucket]:
    entry = ExportedTensor("w", (2, 3), torch.bfloat16, 0)
    bucket = WeightBucket(0, full=(("w", torch.ones(2, 3, dtype=torch.bfloat16)),))
    return ExportManifest(0, "full", (entry,), 1), bucket


def test_an_engine_elsewhere_without_a_route_is_refused_naming_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    engine = StandInEngine(extension="")
    manifest, _ = _manifest()
    with pytest.raises(WeightExportError) as raised:
        VLLMReceiver(engine).begin(manifest)
    assert EXTENSION in str(raised.value)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in str(raised.value)
    assert engine.calls == []  # refused before anything was sent


def _exported_once() -> tuple[StandInEngine, VLLMReceiver, ExportManifest]:
    """A stand-in engine elsewhere, its receiver, and export 0 (one tensor) gone through."""
    engine = StandInEngine()
    receiver = VLLMReceiver(engine, bound_s=5)
    manifest, bucket = _manifest()
    receiver.begin(manifest)
    receiver.receive(bucket)
    receiver.finish()
    return engine, receiver, manifest


def test_through_the_extension_only_method_names_and_bytes_travel() -> None:
    engine, receiver, _ = _exported_once()
    assert engine.calls == ["shardkit_probe", "shardkit_stage", "shardkit_commit"]
    assert isinstance(engine.loaded[0], bytes)  # safetensors bytes, no tensor objects
    assert receiver.serving_version() == 0 == receiver.version


def test_a_failed_commit_keeps_the_version_and_a_full_export_the_mirror_once() -> None:
    from shardkit.core.errors import WeightLoadError

    engine = StandInEngine()
    receiver = VLLMReceiver(engine, bound_s=5)
    manifest, bucket = _manifest()
    for export_id in (0, 1):
        receiver.begin(ExportManifest(export_id, "full", manifest.tensors, 1))
        receiver.receive(bucket)
        receiver.commit()
        receiver.finish()
    engine.refuse_commit = True
    receiver.begin(ExportManifest(2, "full", manifest.tensors, 1))
    assert receiver.mirror == {}  # a full export replaces the mirror: not held twice
    receiver.receive(bucket)
    with pytest.raises(WeightLoadError, match="export 2: RuntimeError: vLLM's reload_weights"):
        receiver.commit()
    receiver.abort(RuntimeError("the commit failed"))
    assert receiver.version == 1 == receiver.serving_version()
    # A delta against version 1 finds no mirror: refused before anything is sent.
    with pytest.raises(WeightLoadError, match="w: not held"):
        receiver.begin(ExportManifest(2, "delta", manifest.tensors, 1))


def test_a_dense_delta_holds_each_tensor_once_and_a_failure_drops_the_mix() -> None:
    # A delta whose bucket went plain (dense: sent whole) replaces the mirror's tensor as it
    # arrives: version k's is not held beside k+1's until the commit. vLLM's worker puts the
    # engine back itself, so a failure after that drops the mirror (it mixes two versions)
    # and the next delta is refused before anything is written: the exporter sends in full.
    from shardkit.core.errors import WeightLoadError

    engine, receiver, manifest = _exported_once()
    old = receiver.mirror["w"]
    dense = WeightBucket(0, full=(("w", torch.full((2, 3), 2.0, dtype=torch.bfloat16)),))
    receiver.begin(ExportManifest(1, "delta", manifest.tensors, 1))
    receiver.receive(dense)
    assert "w" not in receiver.mirror  # dropped: only export 1's tensor is held now
    receiver.commit()
    receiver.finish()
    assert receiver.version == 1 and receiver.mirror["w"].eq(2.0).all()
    assert receiver.mirror["w"] is not old
    engine.refuse_commit = True
    receiver.begin(ExportManifest(2, "delta", manifest.tensors, 1))
    receiver.receive(dense)
    with pytest.raises(WeightLoadError):
        receiver.commit()
    receiver.abort(RuntimeError("the commit failed"))
    assert receiver.mirror == {} and receiver.version is None
    assert receiver.serving_version() == 1  # the engine put itself back
    with pytest.raises(WeightLoadError, match="holds none"):
        receiver.begin(ExportManifest(3, "delta", manifest.tensors, 1))


def test_a_call_past_the_bound_raises_and_others_pass_through() -> None:
    assert bounded(lambda: 7, "a call", 1.0) == 7
    with pytest.raises(ValueError, match="its own"):
        bounded(lambda: (_ for _ in ()).throw(ValueError("its own")), "a call", 1.0)
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(WeightExportError, match=r"did not answer a call within 0.5 s"):
        bounded(never.wait, "a call", 0.5)
    assert time.monotonic() - start < 5
    never.set()


def _silent_engine_export(rank: int, world_size: int, answers: int) -> Any:
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded("shardkit")
    exporter = WeightExporter(
        model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, bound_s=20)
    )
    engine = StandInEngine(answers=answers)
    receiver = VLLMReceiver(engine, bound_s=3) if rank == 0 else None
    start = time.monotonic()
    try:
        exporter.export(receiver)
    except WeightExportError as error:
        return time.monotonic() - start, str(error), engine.calls[-1:]
    finally:
        engine.release.set()  # the stuck helper thread may go now
    return time.monotonic() - start, None, engine.calls[-1:]


@pytest.mark.parametrize("answers", [0, 2, 6])
def test_an_engine_that_stops_answering_ends_the_export_on_every_rank(answers: int) -> None:
    """It never answers (the probe, before the first bucket), or stops after two calls (in
    the middle of the buckets) or at the commit (the sixth call: the probe, four buckets
    staged): every rank raises within the export's bound."""
    results = run_on_ranks(2, _silent_engine_export, answers=answers)
    for seconds, error, _ in results:
        assert error is not None and "did not answer" in error
        assert seconds < 20
    stuck = {0: ["shardkit_probe"], 2: ["shardkit_stage"], 6: ["shardkit_commit"]}[answers]
    assert results[0][2] == stuck
