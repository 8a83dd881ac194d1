"""A receiver's mirror in files: the last export's tensors on disk, read back one at a time.

A delta export is relative to the last one, which a receiver that hands whole tensors to an
engine (``FullTensorReceiver``) must hold itself where the engine cannot give its weights back
(vLLM's CPU build repacks its linear layers after loading them). In memory that copy is the
whole model in the export dtype, on the receiving rank, for the whole run. :class:`MirrorFiles`
keeps each tensor in a file of its own in a private folder instead: written as it arrives,
read back into a fresh tensor when a delta changes it, so the process holds one bucket's
tensors at a time. The files sit in the page cache or on disk, which the kernel may write out
and reclaim; they are read and written with plain calls, never mapped, so no page of them
counts in the process's resident memory. Files are named by a counter, never by a tensor's
name, and every read is checked against the size written. A folder that a killed process left
is removed by the next one made beside it (``stale_folders.py``).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.stale_folders import mark_owner, remove_stale

__all__ = ["MirrorFiles", "read_tensor_file"]


@dataclass(frozen=True, slots=True)
class _Held:
    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes (contiguous, on the CPU), without a copy where it is already so."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def read_tensor_file(
    path: Path, shape: tuple[int, ...], dtype: torch.dtype, name: str
) -> torch.Tensor:
    """A new tensor of ``shape`` and ``dtype`` read from ``path``, which must hold its bytes.

    Read with plain calls, never mapped. Raises ``WeightLoadError`` naming ``name`` where the
    file cannot be read or holds more or fewer bytes.
    """
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * dtype.itemsize
    try:
        with open(path, "rb") as file:
            read = file.readinto(_bytes_of(tensor)) if nbytes else 0
            extra = file.read(1)
    except OSError as error:
        raise WeightLoadError(
            f"the receiver's mirror file of {name} ({path}) cannot be read: {error}"
        ) from error
    if read != nbytes or extra:
        raise WeightLoadError(
            f"the receiver's mirror file of {name} ({path}) holds other than the "
            f"{nbytes} bytes written to it: changed outside this process"
        )
    return tensor


class MirrorFiles(MutableMapping[str, torch.Tensor]):
    """Tensors by name, each in a file under a private folder made in ``parent``.

    Reading a name gives a new tensor each time (changing it changes no file); storing one
    writes its bytes at once. The folder is removed with the object, or by :meth:`close`, or,
    if its process is killed, by the next ``MirrorFiles`` made under ``parent`` on this host.
    """

    def __init__(self, parent: str | os.PathLike[str], label: str = "mirror") -> None:
        Path(parent).mkdir(parents=True, exist_ok=True)
        remove_stale(Path(parent))  # folders of receivers killed before they could
        self.folder = Path(tempfile.mkdtemp(prefix=f"shardkit-{label}-", dir=parent))
        mark_owner(self.folder)
        self._held: dict[str, _Held] = {}
        self._spare: dict[str, _Held] = {}
        """Files a tensor's next version may be written into in place (``take_from``)."""
        self._numbers = itertools.count()
        self._remove = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The shape and dtype held under ``name``, read from no file (None: not held)."""
        held = self._held.get(name)
        return None if held is None else (held.shape, held.dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        held = self._held[name]
        return read_tensor_file(held.path, held.shape, held.dtype, name)

    def read_span(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``name``, flat, read from no more of its file.

        Raises:
            ValueError: the span is not within the tensor.
            WeightLoadError: the file cannot be read or is no longer the size written.
        """
        held = self._held[name]
        numel = math.prod(held.shape)
        if start < 0 or count < 0 or start + count > numel:
            raise ValueError(f"{name}: elements {start}:{start + count} of {numel}")
        span = torch.empty(count, dtype=held.dtype)
        itemsize = held.dtype.itemsize
        try:
            with open(held.path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                file.seek(start * itemsize)
                read = file.readinto(_bytes_of(span)) if count else 0
        except OSError as error:
            raise WeightLoadError(
                f"the receiver's mirror file of {name} ({held.path}) cannot be read: {error}"
            ) from error
        if size != numel * itemsize or read != count * itemsize:
            raise WeightLoadError(
                f"the receiver's mirror file of {name} ({held.path}) holds other than the "
                f"{numel * itemsize} bytes written to it: changed outside this process"
            )
        return span

    def file_of(self, name: str) -> tuple[str, list[int], str]:
        """Where ``name`` is held: its file's path, its shape and its dtype's name.

        Plain values, as vLLM's RPC carries them: an engine's worker on this host reads the
        file itself (``vllm_files.py``).
        """
        held = self._held[name]
        return str(held.path), list(held.shape), str(held.dtype).removeprefix("torch.")

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = tuple(tensor.shape), tensor.dtype
        old = self._held.get(name)
        if old is not None and (old.shape, old.dtype) == (shape, dtype):
            # Rewritten in place: its pages are in the page cache already, where a new file
            # allocates them and the old one's are freed (measured several times slower).
            with open(old.path, "r+b") as file:
                file.write(_bytes_of(tensor))
            return
        spare = self._spare.pop(name, None)
        if spare is not None and (spare.shape, spare.dtype) == (shape, dtype):
            with open(spare.path, "r+b") as file:  # in place too, for the same reason
                file.write(_bytes_of(tensor))
            self._replace(name, spare)
            return
        if spare is not None:
            spare.path.unlink(missing_ok=True)
        path = self.folder / f"{next(self._numbers)}.bin"
        with open(path, "xb") as file:
            file.write(_bytes_of(tensor))
        self._replace(name, _Held(path, tuple(tensor.shape), tensor.dtype))

    def __delitem__(self, name: str) -> None:
        self._held.pop(name).path.unlink(missing_ok=True)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._held))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def clear(self) -> None:
        """Forget every tensor and remove its file, and the spare files (the folder stays)."""
        for held in [*self._held.values(), *self._spare.values()]:
            held.path.unlink(missing_ok=True)
        self._held.clear()
        self._spare.clear()

    def take_from(self, other: MirrorFiles) -> None:
        """Move every file of ``other`` here (renamed, not copied), replacing what it names.

        The files replaced become ``other``'s spares: the next version of the same tensor
        written there goes into one in place, its pages reused (a store that takes each
        export in turn, as a receiver's next mirror does, allocates no new pages).
        """
        for name, held in other._held.items():
            path = self.folder / f"{next(self._numbers)}.bin"
            os.replace(held.path, path)
            old = self._held.get(name)
            self._held[name] = _Held(path, held.shape, held.dtype)
            if old is not None and name not in other._spare:
                other._spare[name] = old
            elif old is not None:
                old.path.unlink(missing_ok=True)
        other._held.clear()

    def _replace(self, name: str, held: _Held) -> None:
        old = self._held.get(name)
        self._held[name] = held
        if old is not None:
            old.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the folder and every file in it, and the spare files (maybe elsewhere)."""
        for spare in self._spare.values():
            spare.path.unlink(missing_ok=True)
        self._held.clear()
        self._spare.clear()
        self._remove()
