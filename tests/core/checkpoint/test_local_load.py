"""Loads planned by each rank alone from the layout record (``checkpoint/local_plan/load.py``).

A checkpoint saved by ``CheckpointManager`` (FSDP at W=2, HSDP 2x2 at W=4) is loaded through
the manager at the same and at other world sizes and meshes, and, as the oracle, through DCP's
own planned load (``.metadata``, the plan exchange) into an app of other initial weights: the
two states must be the same bit for bit, and equal the saved one. During the manager's load,
from DCP's entry to the first read, no collective may run and no plan be exchanged; the same
counter sees DCP's exchange in the oracle's load. No rank may read ``.metadata``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, same_state, state_of, train_app
from tests.core.checkpoint.dcp_checks import CollectivesBeforeWrite


class CollectivesBeforeRead:
    """Counts torch.distributed calls, and DCP's plan exchanges, from DCP's load to its reads."""

    def __enter__(self) -> CollectivesBeforeRead:
        import torch.distributed as dist
        import torch.distributed.checkpoint.state_dict_loader as loader
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.utils import _DistWrapper

        self.calls, self.exchanges, self.counting = 0, 0, False
        self.saved = {name: getattr(dist, name) for name in CollectivesBeforeWrite.NAMES}
        self.originals = (
            loader._load_state_dict,
            FileSystemReader.read_data,
            _DistWrapper.reduce_scatter,
        )
        load_state, read_data, reduce_scatter = self.originals

        def counted(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls += self.counting
                return original(*args, **kwargs)

            return call

        def start(*args: Any, **kwargs: Any) -> Any:
            self.counting = True
            try:
                return load_state(*args, **kwargs)
            finally:
                self.counting = False

        def first_read(reader: Any, *args: Any, **kwargs: Any) -> Any:
            self.counting = False
            return read_data(reader, *args, **kwargs)

        def exchange(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
            self.exchanges += wrapper.use_dist
            return reduce_scatter(wrapper, *args, **kwargs)

        for name, original in self.saved.items():
            setattr(dist, name, counted(original))
        loader._load_state_dict = start
        FileSystemReader.read_data = first_read  # type: ignore[method-assign, assignment]
        _DistWrapper.reduce_scatter = exchange  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint.state_dict_loader as loader
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.utils import _DistWrapper

        for name, original in self.saved.items():
            setattr(dist, name, original)
        loader._load_state_dict = self.originals[0]
        FileSystemReader.read_data = self.originals[1]  # type: ignore[method-assign]
        _DistWrapper.reduce_scatter = self.originals[2]  # type: ignore[method-assign]


class NoMetadataReads:
    """Counts the reads of ``.metadata`` by the project's reader (its only one)."""

    MODULES = (
        "shardkit.core.checkpoint.dcp_reading",
        "shardkit.core.checkpoint.load_checks",
    )

    def __enter__(self) -> NoMetadataReads:
        import importlib

        self.reads = 0
        self.modules = [importlib.import_module(name) for name in self.MODULES]
        self.original = getattr(self.modules[0], "read_dcp_metadata")  # noqa: B009

        def counted(*args: Any) -> Any:
            self.reads += 1
            return self.original(*args)

        for module in self.modules:
            setattr(module, "read_dcp_metadata", counted)  # noqa: B010 (a module's name)
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            setattr(module, "read_dcp_metadata", self.original)  # noqa: B010


def _save(rank: int, world_size: int, root: str, replicas: int) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    app = build_app(world_size, replicas=replicas)
    train_app(app, 2, rank, world_size)
    path = CheckpointManager(root).save(2, {"app": app})
    return {"state": state_of(app), "path": str(path)}


def _load(rank: int, world_size: int, path: str, replicas: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from shardkit.core import CheckpointManager
    from shardkit.core.checkpoint.dcp_reading import SafeFileSystemReader, SafeLoadPlanner

    ours = build_app(world_size, replicas=replicas, seed=7)
    manager = CheckpointManager(Path(path).parent)
    with NoMetadataReads() as metadata, CollectivesBeforeRead() as counted:
        manager.load({"app": ours}, path)
    theirs = build_app(world_size, replicas=replicas, seed=7)
    with CollectivesBeforeRead() as dcp_counted:
        dcp_load(
            {"app": theirs},
            checkpoint_id=path,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
        )
    return {
        "ours": state_of(ours),
        "same_as_dcp": same_state(state_of(ours), state_of(theirs)),
        "collectives": counted.calls,
        "exchanges": counted.exchanges,
        "metadata_reads": metadata.reads,
        "dcp_exchanges": dcp_counted.exchanges,
        "step": ours.step,
    }


CASES = [  # (saved at W, saved replicas, loaded at W, loaded replicas)
    (2, 1, 2, 1),
    (2, 1, 1, 1),
    (2, 1, 3, 1),
    (2, 1, 4, 1),
    (2, 1, 4, 2),  # FSDP to HSDP 2x2
    (4, 2, 4, 2),  # HSDP 2x2, the same layout: the replicas split the reading
    (4, 2, 2, 1),  # HSDP to FSDP
]


@pytest.mark.parametrize(("saved_w", "saved_r", "load_w", "load_r"), CASES)
def test_a_recorded_checkpoint_loads_planned_by_each_rank_alone(
    saved_w: int, saved_r: int, load_w: int, load_r: int, tmp_path: Path
) -> None:
    saved = run_on_ranks(saved_w, _save, root=str(tmp_path), replicas=saved_r)
    path = Path(saved[0]["path"])
    assert (path / "layout.json").is_file() and (path / ".metadata").is_file()
    assert all((path / f"__{r}.index").is_file() for r in range(saved_w))
    loaded = run_on_ranks(load_w, _load, path=str(path), replicas=load_r)
    for rank, result in enumerate(loaded):
        assert result["same_as_dcp"], rank
        assert same_state(result["ours"], saved[0]["state"]), rank
        assert result["step"] == 2
        assert result["collectives"] == result["exchanges"] == 0, (rank, result["collectives"])
        assert result["metadata_reads"] == 0, rank
        # The counter sees DCP's own exchange (one gather of plans, one scatter back).
        assert result["dcp_exchanges"] == 1, rank
