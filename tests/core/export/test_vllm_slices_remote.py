"""VLLMRemoteSliceReceiver and its workers' side, without vLLM: a stand-in engine of TP degree 2
whose two workers serve in threads of this process, over the real transport (Unix sockets and
shared memory, JSON headers, no pickle); and the same behind a stand-in ``vllm serve``.

Each trainer rank's receiver sends its engine rank's windows; each worker loads exactly its
windows, as ``WindowedWeight`` of the full shape, and counts their bytes. The driver refuses
a wrong engine before a byte is sent, and a worker's failed load fails its rank's commit. A
server is paused before its workers serve and resumed after its prefix cache is emptied, the
export failed or not.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardkit.core.errors import WeightExportError, WeightLoadError
from shardkit.core.export import ExportedTensor, ExportManifest, vllm_worker_load
from shardkit.core.export import vllm_slices_worker as worker_side
from shardkit.core.export.tp_export import SlicedBucket
from shardkit.core.export.tp_slices import EngineTP, engine_window
from shardkit.core.export.vllm_slices_remote import VLLMRemoteSliceReceiver
from shardkit.core.export.vllm_slices_worker import serve_slices_on_worker, windows_of_table
from shardkit.core.export.vllm_versions import settle_held
from shardkit.core.export.vllm_worker import EXTENSION
from shardkit.core.export.windowed_weight import WindowedWeight

TP = EngineTP(degree=2, num_heads=2, num_kv_heads=2, head_dim=2, vocab_size=64)
SHAPES = {
    "model.layers.0.mlp.up_proj.weight": (8, 4),  # rows cut
    "model.layers.0.mlp.down_proj.weight": (4, 8),  # columns cut
    "model.layers.0.input_layernorm.weight": (4,),  # whole on both ranks
}
KEY = b"k" * 32
BOUND_S = 10.0
SERVE = "shardkit_serve_slices"


class StandInWorker:
    """One engine rank's worker: what it loaded, and a load that may fail."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loaded: list[tuple[str, Any]] = []
        self.fail = False
        self.model = torch.nn.Linear(2, 2)  # what a held commit keeps as it was

    def get_model(self) -> torch.nn.Module:
        return self.model


class StandInEngine:
    """A ``vllm.LLM`` whose engine core runs elsewhere, reached by the extension's names."""

    def __init__(self, *, degree: int = 2) -> None:
        config = SimpleNamespace(worker_extension_cls=EXTENSION)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=config))
        self.workers = [StandInWorker(r) for r in range(2)]
        self.degree = degree
        self.calls: list[str] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        if method == "shardkit_tp_place":
            return [[w.rank, self.degree] for w in self.workers]
        if method == "shardkit_probe":
            return [["reload_weights", "bfloat16", "a stand-in", os.getpid() + 1]] * 2
        if method == "shardkit_settle":
            return [settle_held(w, *args) for w in self.workers]
        assert method == "shardkit_serve_slices"
        answers: list[Any] = [None, None]

        def serve(worker: StandInWorker) -> None:
            answers[worker.rank] = serve_slices_on_worker(worker, *args)

        threads = [threading.Thread(target=serve, args=(w,)) for w in self.workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return answers

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


@pytest.fixture(autouse=True)
def _stand_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker side's calls into vLLM, answered by the stand-in worker."""

    def load(worker: StandInWorker, path: str, items: list[tuple[str, Any]]) -> None:
        if worker.fail:
            raise RuntimeError("the loader refused it")
        for name, tensor in items:  # copied, as vLLM's loaders copy (the segment is reused)
            held = tensor.held if isinstance(tensor, WindowedWeight) else tensor
            worker.loaded += [(name, held.clone()), (f"{name}:type", type(tensor).__name__)]
        with torch.no_grad():
            worker.model.weight.fill_(float(len(worker.loaded)))  # what a commit changes

    monkeypatch.setattr(worker_side, "tp_place_of_worker", lambda w: (w.rank, 2))
    monkeypatch.setattr(
        worker_side, "choose_path", lambda w, p: ("reload_weights", torch.bfloat16, "stand-in")
    )
    monkeypatch.setattr(vllm_worker_load, "load_on_worker", load)  # the commit's load


def _manifest(dtype: torch.dtype = torch.bfloat16) -> ExportManifest:
    entries = tuple(ExportedTensor(n, s, dtype, 0) for n, s in SHAPES.items())
    return ExportManifest(0, "full", entries, 1)


def _full() -> dict[str, torch.Tensor]:
    return {
        n: torch.arange(torch.Size(s).numel(), dtype=torch.bfloat16).view(s)
        for n, s in SHAPES.items()
    }


def _bucket(rank: int, full: dict[str, torch.Tensor]) -> SlicedBucket:
    windows = []
    for name, tensor in full.items():
        window = engine_window(TP, name, tuple(tensor.shape), rank)
        windows.append((window, tensor[tuple(slice(a, b) for a, b in window.box)].contiguous()))
    return SlicedBucket(0, rank, 2, tuple(windows))


def _on_both(work: Callable[[int], None]) -> list[BaseException | None]:
    """``work(rank)`` for both trainer ranks at once (each waits for its worker)."""
    errors: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as error:
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def _receivers(engine: StandInEngine, tmp_path: Path) -> list[VLLMRemoteSliceReceiver]:
    return [
        VLLMRemoteSliceReceiver(
            TP,
            rank,
            authkey=KEY,
            llm=engine if rank == 0 else None,
            socket_dir=str(tmp_path),
            bound_s=BOUND_S,
        )
        for rank in range(2)
    ]


def _export(receivers: list[VLLMRemoteSliceReceiver], full: dict[str, torch.Tensor]) -> Any:
    """One export on both trainer ranks, as the exporter calls them; each rank's error."""

    def export(rank: int) -> None:
        receivers[rank].begin(_manifest())
        receivers[rank].receive(_bucket(rank, full))
        receivers[rank].commit()
        receivers[rank].finish()

    return _on_both(export)


def test_each_worker_loads_exactly_its_windows(tmp_path: Path) -> None:
    engine = StandInEngine()
    receivers = _receivers(engine, tmp_path)
    full = _full()
    for _ in range(2):  # a second export reuses nothing of the first's sockets
        for worker in engine.workers:
            worker.loaded.clear()
        assert _export(receivers, full) == [None, None]
        for rank, worker in enumerate(engine.workers):
            loaded = dict(worker.loaded)
            for name, tensor in full.items():
                window = engine_window(TP, name, tuple(tensor.shape), rank)
                part = tensor[tuple(slice(a, b) for a, b in window.box)]
                assert torch.equal(loaded[name], part), (rank, name)
                whole = window.dim is None
                assert loaded[f"{name}:type"] == ("Tensor" if whole else "WindowedWeight")
        served = receivers[0].served
        windows = [sum(_bucket(r, full).windows[i][1].nbytes for i in range(3)) for r in range(2)]
        assert [s["received_bytes"] for s in served] == windows
        assert [s["finished"] for s in served] == [1, 1]
    assert engine.calls.count("reset_prefix_cache") == 2
    assert list(tmp_path.iterdir()) == []  # every socket gone


def test_a_wrong_engine_is_refused_before_a_byte_is_sent(tmp_path: Path) -> None:
    engine = StandInEngine(degree=4)
    driver = _receivers(engine, tmp_path)[0]
    with pytest.raises(WeightExportError, match=r"TP degree 2.*\(0, 4\).*nothing was written"):
        driver.begin(_manifest())
    engine.degree = 2
    with pytest.raises(WeightLoadError, match=re.escape("sent as torch.float32")):
        driver.begin(_manifest(torch.float32))
    assert "shardkit_serve_slices" not in engine.calls


def test_a_workers_failed_load_fails_its_ranks_commit(tmp_path: Path) -> None:
    engine = StandInEngine()
    engine.workers[1].fail = True
    errors = _export(_receivers(engine, tmp_path), _full())
    assert isinstance(errors[1], WeightLoadError)
    assert "the loader refused it" in str(errors[1])
    # The driver hears it too, in every worker's answer.
    assert isinstance(errors[0], WeightLoadError)
    assert "engine rank 1: RuntimeError" in str(errors[0]), errors[0]
    assert "the loader refused it" in str(errors[0]) and "put back" in str(errors[0])


def test_a_failed_export_is_undone_on_every_worker(tmp_path: Path) -> None:
    # Worker 0 loads its windows at the end, held; worker 1's load raises (put back at once).
    # Every trainer rank's abort (the exporter's) has the driver undo worker 0's too: the
    # engine's two ranks serve what they served, complete. The next export goes through.
    engine = StandInEngine()
    before = [w.model.weight.detach().clone() for w in engine.workers]
    receivers = _receivers(engine, tmp_path)
    engine.workers[1].fail = True
    errors = _export(receivers, _full())
    assert all(isinstance(e, WeightLoadError) for e in errors), errors
    for receiver, error in zip(receivers, errors, strict=True):
        receiver.abort(error or RuntimeError("a peer failed"))
    assert engine.calls.count("shardkit_settle") == 1
    undone = [torch.equal(w.model.weight, b) for w, b in zip(engine.workers, before, strict=True)]
    assert undone == [True, True]
    assert [r.version for r in receivers] == [None, None]
    engine.workers[1].fail = False
    assert _export(receivers, _full()) == [None, None]
    assert [r.version for r in receivers] == [0, 0]
    assert all(w.model.weight[0, 0] > 0 for w in engine.workers)


def test_a_window_table_from_another_process_is_checked() -> None:
    assert windows_of_table({"w": [[8, 4], 0, 4, 8]})["w"].local_shape == (4, 4)
    for bad in ({"w": [[8, 4], 0, 4, 9]}, {"w": [[8, 4], 2, 0, 1]}, {"w": [[8], None, "a", 1]}):
        with pytest.raises(WeightLoadError, match="malformed window"):
            windows_of_table(bad)


def _server_of(engine: StandInEngine) -> Any:
    """A stand-in ``vllm serve`` of TP 2 whose ``/collective_rpc`` reaches ``engine``'s workers."""

    def answer(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/collective_rpc":
            return 200, {"results": engine.collective_rpc(body["method"], tuple(body["args"]))}
        if path == "/is_paused":
            return 200, {"is_paused": False}
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        return 200, {"status": "ok"}  # /pause?mode=wait, /resume

    return answer


@pytest.mark.parametrize("fails", [False, True])
def test_a_server_is_paused_around_the_workers_load_and_resumed(
    tmp_path: Path, fails: bool
) -> None:
    from tests.core.export.stand_in_server import StandInServer

    engine = StandInEngine()
    engine.workers[1].fail = fails
    server = StandInServer(_server_of(engine))
    try:
        receivers = _receivers(engine, tmp_path)
        receivers[0] = VLLMRemoteSliceReceiver(
            TP, 0, authkey=KEY, url=server.url, socket_dir=str(tmp_path), bound_s=BOUND_S
        )
        errors = _export(receivers, _full())
        if fails:  # as the exporter does on every rank
            for receiver, error in zip(receivers, errors, strict=True):
                receiver.abort(error or RuntimeError("a peer failed"))
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
    assert (errors == [None, None]) is not fails
    paths = [p.split("?")[0] for p in server.paths()]
    serve = next(i for i, (p, b) in enumerate(server.seen) if b.get("method") == SERVE)
    assert paths[serve - 2 : serve] == ["/is_paused", "/pause"]  # before the workers load
    # After: every worker's load kept (or, failed, undone) first, then the cache and the resume.
    settle = next(b.get("method") for _, b in server.seen[serve + 1 :])
    assert settle == "shardkit_settle", server.seen[serve + 1 :]
    assert paths[serve + 1 :] == ["/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert [len(w.loaded) > 0 for w in engine.workers] == [True, not fails]
