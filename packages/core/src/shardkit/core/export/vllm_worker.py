"""The extension vLLM mixes into its worker: shardkit's calls on the engine, by method name.

vLLM's ``worker_extension_cls`` (``EXTENSION``) adds these methods to the worker of an engine
core in a process of its own, where ``collective_rpc`` reaches them by name: plain strings,
ints and bytes travel, no pickled function (vLLM refuses those unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Each method hands on to the module that does the
work: ``vllm_worker_load`` (a bucket loaded, a staged version committed), ``vllm_files`` (an
export committed from files), ``vllm_versions``
(staging, the version served), ``vllm_server_worker`` (one export served into a
``vllm serve``), ``vllm_slices_worker`` (one engine rank's windows of a TP-sliced export)
and ``vllm_read_back`` (digests of the weights the engine computes with). The functions of
``vllm_worker_load`` are also named here, as before.
"""

from __future__ import annotations

from typing import Any

from shardkit.core.export.vllm_files import commit_files_on_worker
from shardkit.core.export.vllm_read_back import partition_digests, served_digests
from shardkit.core.export.vllm_server_worker import serve_export_on_worker
from shardkit.core.export.vllm_slices_worker import serve_slices_on_worker, tp_place_of_worker
from shardkit.core.export.vllm_versions import serving_version, settle_held, stage_on_worker
from shardkit.core.export.vllm_worker_load import (
    LoadPath,
    choose_path,
    commit_on_worker,
    load_on_worker,
    probe_worker,
)

__all__ = [
    "EXTENSION",
    "LoadPath",
    "ShardkitWorkerExtension",
    "choose_path",
    "commit_on_worker",
    "load_on_worker",
    "probe_worker",
]

EXTENSION = "shardkit.core.export.vllm_worker.ShardkitWorkerExtension"
"""What to pass as vLLM's ``worker_extension_cls`` for an engine core in its own process."""


class ShardkitWorkerExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls=EXTENSION``).

    ``collective_rpc`` then calls them by name: plain strings, ints and bytes travel, no
    pickled function. Their names start with ``shardkit_`` (vLLM refuses an extension whose
    names collide with its worker's).
    """

    def shardkit_probe(self, path: LoadPath) -> tuple[str | None, str, str, int]:
        """See :func:`probe_worker`."""
        return probe_worker(self, path)

    def shardkit_load(self, path: str, payload: bytes) -> None:
        """See :func:`load_on_worker` (a bucket as safetensors bytes)."""
        load_on_worker(self, path, payload)

    def shardkit_stage(self, version: int, payload: bytes) -> None:
        """See :func:`~shardkit.core.export.vllm_versions.stage_on_worker`."""
        stage_on_worker(self, version, payload)

    def shardkit_commit(self, version: int, path: str, hold: bool = False) -> int:
        """See :func:`commit_on_worker`."""
        return commit_on_worker(self, version, path, hold)

    def shardkit_commit_files(
        self, version: int, path: str, load: list[Any], back: list[Any]
    ) -> int:
        """See :func:`~shardkit.core.export.vllm_files.commit_files_on_worker`."""
        return commit_files_on_worker(self, version, path, load, back)

    def shardkit_settle(self, keep: bool) -> int | None:
        """See :func:`~shardkit.core.export.vllm_versions.settle_held`."""
        return settle_held(self, keep)

    def shardkit_serving_version(self) -> int | None:
        """See :func:`~shardkit.core.export.vllm_versions.serving_version`."""
        return serving_version(self)

    def shardkit_serve_export(self, address: str, authkey_hex: str, bound_s: float) -> Any:
        """See :func:`~shardkit.core.export.vllm_server_worker.serve_export_on_worker`."""
        return serve_export_on_worker(self, address, authkey_hex, bound_s)

    def shardkit_tp_place(self) -> tuple[int, int]:
        """See :func:`~shardkit.core.export.vllm_slices_worker.tp_place_of_worker`."""
        return tp_place_of_worker(self)

    def shardkit_serve_slices(
        self, addresses: list[str], authkey_hex: str, bound_s: float, tables: list[Any]
    ) -> dict[str, Any]:
        """See :func:`~shardkit.core.export.vllm_slices_worker.serve_slices_on_worker`."""
        return serve_slices_on_worker(self, addresses, authkey_hex, bound_s, tables)

    def shardkit_partition_digests(self) -> dict[str, list[Any]]:
        """See :func:`~shardkit.core.export.vllm_read_back.partition_digests` (JSON)."""
        return partition_digests(self)

    def shardkit_weight_digests(self) -> dict[str, list[Any]]:
        """See :func:`~shardkit.core.export.vllm_read_back.served_digests` (JSON)."""
        return served_digests(self)
