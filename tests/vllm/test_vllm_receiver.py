"""vLLM as an export's receiver: after a full or a delta export, an engine's greedy tokens and
log-probabilities equal, bit for bit, those of an engine started from the exported weights; a
load that fails partway at the commit leaves the engine serving what it served (its version
and its outputs), and one streamed bucket by bucket names what it wrote.

Three engines start in this process, once for the module (vLLM's CPU build: bf16, eager): the
receiving one, and one from each set of weights exported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightLoadError
from shardkit.core.export import ExportedTensor, ExportManifest, WeightBucket
from shardkit.core.export.mirror_files import MirrorFiles
from shardkit.core.export.vllm import VLLMReceiver, engine_dtype, vllm_receiver
from shardkit.core.export.vllm_worker import choose_path
from tests.vllm.engines import (
    delta_export,
    export_into,
    full_export,
    greedy,
    perturbed,
    save_tiny_qwen2,
    save_weights_beside,
    start_engine,
    with_a_bad_tensor,
    with_changes,
)


@dataclass(frozen=True, slots=True)
class Engines:
    """The receiving engine, started from the first weights, and two references."""

    receiving: Any
    first: dict[str, torch.Tensor]
    second: dict[str, torch.Tensor]
    """What the full export sends; ``second_engine`` was started from it."""
    second_engine: Any
    third: dict[str, torch.Tensor]
    """``second`` with a few elements changed (the delta export); ``third_engine``'s weights."""
    third_engine: Any


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("vllm")
    first = save_tiny_qwen2(root / "first", seed=0)
    second = perturbed(first, seed=1)
    third = with_changes(second, seed=2)
    receiving = start_engine(root / "first")
    second_engine = start_engine(save_weights_beside(root / "first", root / "second", second))
    third_engine = start_engine(save_weights_beside(root / "first", root / "third", third))
    yield Engines(receiving, first, second, second_engine, third, third_engine)


def test_full_export_equals_a_fresh_engine(engines: Engines) -> None:
    before = greedy(engines.receiving)
    receiver = vllm_receiver(engines.receiving)
    assert receiver.dtype == engine_dtype(engines.receiving) == torch.bfloat16

    export_into(receiver, *full_export(engines.second))

    after = greedy(engines.receiving)
    assert after == greedy(engines.second_engine)
    assert after != before  # the export changed what the engine computes


def test_delta_export_equals_a_fresh_engine(engines: Engines) -> None:
    receiver = vllm_receiver(engines.receiving)
    export_into(receiver, *full_export(engines.second, export_id=0))
    manifest, buckets = delta_export(engines.second, engines.third, export_id=1)
    changes = [c for b in buckets for _, c in b.changed]
    assert sum(c.count for c in changes) < 100
    assert any(c.stepped is not None and c.stepped.numel() for c in changes)  # both encodings

    export_into(receiver, manifest, buckets)

    assert greedy(engines.receiving) == greedy(engines.third_engine)
    assert greedy(engines.third_engine) != greedy(engines.second_engine)  # the delta counts


def test_the_cpu_build_takes_reload_weights_not_load_weights(engines: Engines) -> None:
    # vLLM's CPU build repacks the linear layers' weights after loading: the model's
    # load_weights cannot take them, and forcing it is refused in begin, before the first
    # bucket: nothing is written.
    manifest, _ = full_export(engines.second)
    forced = vllm_receiver(engines.receiving, path="load_weights")
    with pytest.raises(WeightLoadError, match=r"lost their weight loader"):
        forced.begin(manifest)
    forced.abort(RuntimeError("refused"))


def test_an_export_that_does_not_fit_the_engine_is_refused_before_any_write(
    engines: Engines,
) -> None:
    receiver = vllm_receiver(engines.receiving)
    in_fp32 = {name: t.float() for name, t in engines.second.items()}
    with pytest.raises(WeightLoadError, match=r"nothing was written.*model\.embed_tokens"):
        receiver.begin(full_export(in_fp32)[0])

    manifest, _ = full_export(engines.second)
    bad_name = "model.layers.1.self_attn.q_proj.weight"
    entries = tuple(_with_shape(e, (7, 3)) if e.name == bad_name else e for e in manifest.tensors)
    entries += (ExportedTensor("model.extra.weight", (4,), torch.bfloat16, 0),)
    with pytest.raises(WeightLoadError) as caught:
        receiver.begin(_with_tensors(manifest, entries))
    message = str(caught.value)
    assert f"{bad_name}: sent as [7, 3], the engine's checkpoint holds [128, 128]" in message
    assert "model.extra.weight: not a tensor of the engine's checkpoint" in message
    assert receiver.loaded == []


def test_a_load_failing_at_the_commit_leaves_the_engine_serving_what_it_served(
    engines: Engines,
) -> None:
    receiver = vllm_receiver(engines.receiving)
    export_into(receiver, *full_export(engines.third, export_id=4))
    assert receiver.serving_version() == 4 == receiver.version
    before = greedy(engines.receiving)
    assert before == greedy(engines.third_engine)
    # The second layer's q_proj arrives in a shape vLLM's loader refuses: the commit's one
    # load raises after the embeddings and the first layer went in.
    bad_name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(WeightLoadError) as caught:
        export_into(receiver, *with_a_bad_tensor(engines.second, bad_name, export_id=5))
    message = str(caught.value)
    assert "export 5" in message and "put back" in message and "serves export 4" in message
    assert receiver.serving_version() == 4 == receiver.version
    assert greedy(engines.receiving) == before  # version 4, complete
    # The full export dropped the mirror it would have applied deltas to (the weights are held
    # once while a full export stages): a delta against version 4 is refused with nothing
    # written (the exporter sends a full export after any failure), and a full one applies.
    with pytest.raises(WeightLoadError, match="weights held; nothing was written"):
        export_into(receiver, *delta_export(engines.third, engines.second, export_id=5))
    assert receiver.serving_version() == 4
    assert greedy(engines.receiving) == before
    export_into(receiver, *full_export(engines.second, export_id=5))
    assert greedy(engines.receiving) == greedy(engines.second_engine)
    assert receiver.serving_version() == 5


def test_the_lean_receiver_streams_full_exports_and_keeps_no_copy(engines: Engines) -> None:
    # keep_mirror=False, all_or_nothing=False: each bucket loaded as it arrives, nothing of
    # the model kept on this side; a delta has nothing to apply to and is refused unwritten.
    receiver = vllm_receiver(engines.receiving, keep_mirror=False, all_or_nothing=False)
    export_into(receiver, *full_export(engines.second, export_id=0))
    assert greedy(engines.receiving) == greedy(engines.second_engine)
    assert receiver.mirror == {} and not receiver.holds_exports
    with pytest.raises(WeightLoadError, match="keep_mirror=True"):
        receiver.begin(delta_export(engines.second, engines.third, export_id=1)[0])
    receiver.abort(RuntimeError("refused"))
    assert greedy(engines.receiving) == greedy(engines.second_engine)


def test_deltas_stream_in_with_the_mirror_in_files(engines: Engines, tmp_path: Path) -> None:
    # all_or_nothing=False, mirror_dir: each bucket loaded as it arrives, the last export in
    # files (vLLM's CPU build cannot give its weights back), nothing of the model in memory.
    receiver = vllm_receiver(engines.receiving, all_or_nothing=False, mirror_dir=tmp_path)
    export_into(receiver, *full_export(engines.second, export_id=0))
    assert isinstance(receiver.mirror, MirrorFiles) and len(receiver.mirror) == len(engines.second)
    for export_id, (before, after) in enumerate(
        [(engines.second, engines.third), (engines.third, engines.second)], start=1
    ):
        export_into(receiver, *delta_export(before, after, export_id=export_id))
        assert receiver.version == export_id
        assert all(torch.equal(receiver.mirror[n], t) for n, t in after.items())
    assert greedy(engines.receiving) == greedy(engines.second_engine)
    export_into(receiver, *delta_export(engines.second, engines.third, export_id=3))
    assert greedy(engines.receiving) == greedy(engines.third_engine)
    assert len(list(receiver.mirror.folder.glob("*.bin"))) == len(engines.third)


def test_versions_in_files_load_at_the_commit_and_put_the_last_back(
    engines: Engines, tmp_path: Path
) -> None:
    # All or nothing with the mirror in files: each export is written to files beside the
    # last one's, nothing is staged on the worker, and the commit has the worker load the
    # files (vllm_files.py); a load that raises is followed by the last export's files.
    receiver = vllm_receiver(engines.receiving, mirror_dir=tmp_path)
    export_into(receiver, *full_export(engines.second, export_id=0))
    assert greedy(engines.receiving) == greedy(engines.second_engine)
    export_into(receiver, *delta_export(engines.second, engines.third, export_id=1))
    assert greedy(engines.receiving) == greedy(engines.third_engine)
    assert receiver.serving_version() == 1 == receiver.version
    assert receiver._staged.loads == [] and len(receiver._next_mirror) == 0
    before = greedy(engines.receiving)
    bad_name = "model.layers.1.self_attn.q_proj.weight"

    with pytest.raises(WeightLoadError) as caught:
        export_into(receiver, *with_a_bad_tensor(engines.second, bad_name, export_id=2))

    message = str(caught.value)
    assert "export 2" in message and "loaded again from their files" in message
    assert "serves export 1" in message
    assert receiver.serving_version() == 1 == receiver.version
    assert greedy(engines.receiving) == before  # version 1, complete
    # Its files were never touched: a delta against version 1 applies.
    mirror = receiver.mirror
    assert isinstance(mirror, MirrorFiles)
    assert all(torch.equal(mirror[n], t) for n, t in engines.third.items())
    export_into(receiver, *delta_export(engines.third, engines.second, export_id=2))
    assert greedy(engines.receiving) == greedy(engines.second_engine)
    assert receiver.serving_version() == 2


def test_a_first_export_in_files_that_fails_puts_back_the_checkpoint_the_engine_started_from(
    engines: Engines, tmp_path: Path
) -> None:
    # Nothing is in files before the first export into an engine: the worker puts back the
    # safetensors folder the engine started from (here the reference engine of the second
    # weights, which no export has touched), read from disk, not a copy kept in memory.
    engine = engines.second_engine
    before = greedy(engine)
    receiver = vllm_receiver(engine, mirror_dir=tmp_path)
    bad_name = "model.layers.1.self_attn.q_proj.weight"

    with pytest.raises(WeightLoadError, match="from the checkpoint it started from"):
        export_into(receiver, *with_a_bad_tensor(engines.third, bad_name, export_id=0))

    assert receiver.serving_version() is None and receiver.version is None
    assert greedy(engine) == before


def test_a_streamed_load_failing_partway_names_the_tensors_written(engines: Engines) -> None:
    # The manifest fits; one tensor of the second layer's bucket does not (a sender's bug).
    receiver = VLLMReceiver(engines.receiving, all_or_nothing=False)
    manifest, buckets = full_export(engines.second)
    bad_name = "model.layers.1.self_attn.q_proj.weight"
    failing = next(b for b in buckets if bad_name in b.names)
    bad = torch.zeros(7, 3, dtype=torch.bfloat16)
    buckets[failing.index] = WeightBucket(
        index=failing.index,
        full=tuple((n, bad if n == bad_name else t) for n, t in failing.full),
    )
    written = [n for b in buckets[: failing.index] for n in b.names]

    with pytest.raises(WeightLoadError) as caught:
        export_into(receiver, manifest, buckets)

    message = str(caught.value)
    assert f"bucket {failing.index}" in message and bad_name in message
    assert "given back their previous weights" in message
    assert message.endswith(", ".join(written))
    assert receiver.loaded == written
    # The engine runs on, and the next full export makes it whole again.
    greedy(engines.receiving)
    export_into(vllm_receiver(engines.receiving), *full_export(engines.second))
    assert greedy(engines.receiving) == greedy(engines.second_engine)


def _with_shape(entry: ExportedTensor, shape: tuple[int, ...]) -> ExportedTensor:
    return ExportedTensor(entry.name, shape, entry.dtype, entry.bucket)


def _with_tensors(manifest: ExportManifest, entries: tuple[ExportedTensor, ...]) -> ExportManifest:
    return ExportManifest(
        export_id=manifest.export_id,
        kind=manifest.kind,
        tensors=entries,
        bucket_count=manifest.bucket_count,
    )


class _Linear(torch.nn.Module):
    def __init__(self, *, loader: bool) -> None:
        super().__init__()
        self.quant_method = object()  # what marks vLLM's linear and embedding layers
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        if loader:
            self.weight.weight_loader = print  # type: ignore[attr-defined]


@dataclass
class _Worker:
    """What the path choice reads of vLLM's worker."""

    model_runner: Any


def _fake_worker(*, loader: bool, reload: bool) -> Any:
    config = type("Config", (), {"dtype": torch.bfloat16, "quantization": None})()
    runner = type("Runner", (), {"model_config": config, "model": _Linear(loader=loader)})()
    worker = _Worker(model_runner=runner)
    if reload:
        worker.reload_weights = print  # type: ignore[attr-defined]
    return worker


@pytest.mark.parametrize(
    ("loader", "reload", "path"),
    [(True, True, "load_weights"), (False, True, "reload_weights"), (False, False, None)],
)
def test_the_path_follows_what_the_model_and_worker_offer(
    loader: bool, reload: bool, path: str | None
) -> None:
    chosen, dtype, _ = choose_path(_fake_worker(loader=loader, reload=reload), "auto")
    assert (chosen, dtype) == (path, torch.bfloat16)


def test_a_receiver_needs_an_engine() -> None:
    with pytest.raises(TypeError, match="offers no way to its worker"):
        VLLMReceiver(object())
