"""What a load does before its first read, counted on each rank (issue 85's "Done when").

``LoadCounter`` counts, from its entry to the load's first read (the first
``FileSystemReader.read_data`` inside DCP's ``_load_state_dict``; the checks before it read
the values that are not tensors through the same reader, and are counted in): every
torch.distributed call by name with its tensor's bytes, wherever it is called from (the
function is replaced in ``torch.distributed`` and in every shardkit module that imported it
by name), DCP's plan exchanges (``_DistWrapper.reduce_scatter`` with a process group); and,
for the whole of it, every open of a ``.metadata`` file (``open``, ``io.open``, ``os.open``).
"""

from __future__ import annotations

import builtins
import io
import os
import sys
from typing import Any

import torch

__all__ = ["COLLECTIVES", "LoadCounter"]

COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "scatter",
    "scatter_object_list", "send",
)  # fmt: skip
"""torch.distributed's calls that talk to other ranks."""


def _bytes_of(args: tuple[Any, ...]) -> int:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.numel() * arg.element_size()
    return -1  # an object collective: its payload is pickled inside torch


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class LoadCounter:
    """Counts what happens from ``__enter__`` to the first read of a checkpoint's data."""

    def __enter__(self) -> LoadCounter:
        import torch.distributed as dist
        import torch.distributed.checkpoint.state_dict_loader as loader
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.utils import _DistWrapper

        self.before_reads: list[tuple[str, int]] = []  # (name, bytes) of each call
        self.exchanges = 0
        self.metadata_opens = 0
        self.counting = True
        originals = {getattr(dist, name): name for name in COLLECTIVES if hasattr(dist, name)}
        modules = [dist] + [m for n, m in list(sys.modules.items()) if n.startswith("shardkit")]
        self.patched: list[tuple[Any, str, Any]] = []
        for module in modules:
            for attribute, value in list(vars(module).items()):
                if callable(value) and _hashable(value) and value in originals:
                    self.patched.append((module, attribute, value))
                    setattr(module, attribute, self._counted(originals[value], value))
        read_data, reduce_scatter = FileSystemReader.read_data, _DistWrapper.reduce_scatter
        load_state = loader._load_state_dict
        self.loading = False

        def load(*args: Any, **kwargs: Any) -> Any:
            self.loading = True
            try:
                return load_state(*args, **kwargs)
            finally:
                self.loading = False

        def first_read(reader: Any, *args: Any, **kwargs: Any) -> Any:
            self.counting = self.counting and not self.loading
            return read_data(reader, *args, **kwargs)

        def exchange(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
            self.exchanges += bool(wrapper.use_dist) and self.counting
            return reduce_scatter(wrapper, *args, **kwargs)

        self.patched += [
            (FileSystemReader, "read_data", read_data),
            (_DistWrapper, "reduce_scatter", reduce_scatter),
            (loader, "_load_state_dict", load_state),
        ]
        loader._load_state_dict = load
        FileSystemReader.read_data = first_read  # type: ignore[method-assign, assignment]
        _DistWrapper.reduce_scatter = exchange  # type: ignore[method-assign, assignment]
        for module, name in ((builtins, "open"), (io, "open"), (os, "open")):
            original = getattr(module, name)
            self.patched.append((module, name, original))
            setattr(module, name, self._watched(original))
        return self

    def _counted(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.before_reads.append((name, _bytes_of(args)))
            return original(*args, **kwargs)

        return call

    def _watched(self, original: Any) -> Any:
        def opened(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike) and str(os.fspath(path)).endswith(".metadata"):
                self.metadata_opens += 1
            return original(path, *args, **kwargs)

        return opened

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self.patched):
            setattr(module, name, original)
